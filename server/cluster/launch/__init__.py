"""`jaxserve launch`: the router and workers placed on a Ray cluster (Ray is an optional extra)."""
