"""Who a peer is and what it may do: mutual TLS, per-identity server names, the authorization table."""
