"""Data-parallel serving on Ray Serve: the application, the ingress, the replicas, the router and the merged metrics
(``kv8 serve --data-parallel-backend ray``)."""
