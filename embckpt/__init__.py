"""embckpt."""
