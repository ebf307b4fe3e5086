"""What the control plane, the node agents and the ranks share: the store's keys and records, the
job store that alone speaks to the store, pure policy, placement, beats and monitor events."""
