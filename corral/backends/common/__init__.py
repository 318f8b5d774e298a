"""What every backend shares, and none owns: the agent's wire protocol and its file tree, the node's sandbox
network, and the privileged host setup (cgroup layout, mount namespace, layer mounts, native helpers, reaping)."""
