"""Parallelisms as data and as functions: the degrees of a run (dist_train/parallel_dims.py), its one device mesh (mesh.py), and the
functions that apply each parallelism to a model in one fixed order (apply.py; FSDP2 in fsdp.py)."""
