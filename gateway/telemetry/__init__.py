"""What the gateway writes down: Prometheus metrics, a log line per request, OpenTelemetry spans."""
