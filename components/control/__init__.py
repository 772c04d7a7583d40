"""The control plane: the router (the one owner of topology state), scale operations, capacity."""
