"""The scheduler that `run` and the farm share: its config, the batch session, the job queue, the
stage flow and its steps, retries, the watch, the group pool, progress, repair, the one-batch driver."""
