"""DSec: the sandbox service (apiserver, edge, watcher), its substrates, images, snapshots and the
per-sandbox trajectory log. Imports neither the model nor torch."""
