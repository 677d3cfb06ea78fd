"""Parallelisms as data and as functions: the degrees of a run (dist_train/parallel_dims.py), what each parallelism
shards and sends (catalog.py, torch-free), DeepSpeed ZeRO's buckets sized from the model (buckets.py, torch-free), its
one device mesh (mesh.py), and the functions that apply each parallelism to a model in one fixed order (apply.py;
FSDP2 in fsdp.py, tensor parallelism in tensor_parallel.py)."""
