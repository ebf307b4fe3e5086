"""Inside a trainer process: the recovery driver and everything it drives on its rank (membership,
process groups, failure-aware waits, re-join, reporting)."""
