"""Checkpoint tiers: a node-local copy of every checkpoint, a replica on a peer node, the durable
directory every K checkpoints; restores read each file from the nearest copy (docs/ARCHITECTURE.md,
"Tiers")."""
