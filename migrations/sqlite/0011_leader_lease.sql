-- The leader lease of a controller group (docs/ha.md): one row, created here, naming the
-- controller that leads, its epoch (one more at every takeover) and until when, by the database's
-- clock. Every write of the leader checks it (fencing); SQLite serves one controller, whose lease
-- is uncontested.
CREATE TABLE controller_lease (
    name          TEXT    PRIMARY KEY,              -- 'leader'
    holder        TEXT    NOT NULL,                 -- the leading controller's id ('' before any)
    epoch         INTEGER  NOT NULL,                 -- +1 at every takeover
    address       TEXT    NOT NULL,                 -- where the leader serves gRPC
    expires_at_ms INTEGER  NOT NULL                  -- the lease ends here (database clock, ms)
);
INSERT INTO controller_lease (name, holder, epoch, address, expires_at_ms) VALUES ('leader', '', 0, '', 0);
