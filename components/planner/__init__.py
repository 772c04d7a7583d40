"""Autoscaling: the planner's policy and service, and a connector for Dynamo's planner."""
