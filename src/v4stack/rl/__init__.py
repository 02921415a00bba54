"""Reinforcement learning: tasks, the agent worker, the data path, GRPO, the fleet, the loop."""
