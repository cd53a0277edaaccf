"""The replay validator: sampled sessions replayed on other routes or a reference."""
