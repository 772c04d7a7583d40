"""Autoscaling: our planner's policy and service, and the system side of Dynamo's virtual connector."""
