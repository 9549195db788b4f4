"""What the controller keeps: the state database with its rollout leases (``state``), the HTML
report read from it (``report``) and watch's Prometheus series (``metrics``)."""
