-- Autovacuum settings for the receipts table. Per-table settings cannot live in
-- postgresql.conf, and the table exists only once the controller has started against the
-- database (it creates its tables itself), so run this after that first start:
--
--   sudo -u postgres psql -v ON_ERROR_STOP=1 -d trainyard -f deploy/postgres/receipts-autovacuum.sql
--
-- Run it again after upgrades that rebuild the table (a migration that recreates it drops its
-- settings); running it twice does no harm.
--
-- Why: receipts is append-only. Every row is inserted once (a batch per transaction) and never
-- updated or deleted, so it makes almost no dead rows, and the autovacuum triggers that count
-- dead rows never fire. What it needs instead:
-- - ANALYZE often enough that the planner's row estimates follow a table growing by millions of
--   rows a day (the default waits for 10% growth, which on a large table is a long time);
-- - insert-driven VACUUM (PostgreSQL 13 and newer) that marks pages all-visible, which lets
--   `count(*)` and `max(seq)` per job (ctl status, the acks agents get on reconnect) answer from
--   the indexes alone, and that freezes old rows a little at a time instead of in one
--   anti-wraparound vacuum of the whole table. The default waits for 20% growth.

ALTER TABLE receipts SET (
    -- ANALYZE after 1% growth (plus 10,000 rows), instead of 10%.
    autovacuum_analyze_scale_factor = 0.01,
    autovacuum_analyze_threshold = 10000,
    -- VACUUM after inserts of 2% of the table (plus 100,000 rows), instead of 20%.
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_vacuum_insert_threshold = 100000,
    -- Let those vacuums run at disk speed rather than at the global cost limit, which caps the
    -- pages they may dirty at a few tens of MB/s, about what a busy fleet appends. Each one
    -- mostly reads the pages appended since the last: the visibility map skips the rest.
    autovacuum_vacuum_cost_delay = 0
);
