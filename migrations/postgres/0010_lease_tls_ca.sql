-- Which TLS CA the leading controller serves under (the SHA-256 of its --tls-dir ca.pem, '' for
-- plaintext), so that a controller with another CA refuses to join the group: agents that trust
-- one CA cannot reach a leader whose certificate another signed (docs/ha.md).
ALTER TABLE controller_lease ADD COLUMN tls_ca TEXT NOT NULL DEFAULT '';
