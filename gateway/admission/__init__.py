"""Who gets a place, and when: API keys and rate limits, a client's heavy bodies, the bounded queue,
the backlog a deadline is judged against."""
