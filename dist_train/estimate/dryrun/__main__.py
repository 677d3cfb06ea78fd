"""`python -m dist_train.estimate.dryrun`: one rank of a dry run (dist_train/estimate/dryrun/rank.py)."""

from dist_train.estimate.dryrun.rank import main

main()
