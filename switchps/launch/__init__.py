"""Starting a run's roles: locally, on Ray, under SLURM; what runs where and in which order."""
