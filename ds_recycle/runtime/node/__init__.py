"""The agent of one node (``ds-recycle launch``): starts and reaps its ranks, respawns them, links
the node to the coordinator (or hosts it), fences the node when the link is lost."""
