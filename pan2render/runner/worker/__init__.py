"""The GPU side: the worker that runs a group's calls on its pipeline, its lanes and test hooks."""
