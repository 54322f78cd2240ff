"""End-to-end suites, cluster definitions (``clusters/``) and the local control
plane (``localcluster``) that tests, the demo and e2e share."""
