"""`plait plan`: the whole job's layout and its overlap chosen together, within memory."""
