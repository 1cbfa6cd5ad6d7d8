"""The engine link: the socket, workers joining and leaving, routing, requests in flight, models
loaded on demand."""
