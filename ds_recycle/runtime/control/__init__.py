"""The control plane: the coordinator (one decision per failure, leave and join), the host that
serves the job's store and runs a generation, and the status page."""
