"""The worker's side of the weights path: the watch stream it keeps open on the registry, the fetches, and
its relay to other workers."""
