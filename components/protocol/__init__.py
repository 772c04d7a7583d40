"""What crosses between router, worker and planner, torch-free: control messages, the rank
lifecycle, the expert placement and its algebra, weight-transfer manifests, the topology and
scale records, and the component configs."""
