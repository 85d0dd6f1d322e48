"""The engine (scheduler) side: block exchange, decode-time pressure, metrics."""
