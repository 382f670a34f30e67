-- The role and the database of trainyard's fleet store. Run once, as a superuser, with psql:
--
--   sudo -u postgres psql -v ON_ERROR_STOP=1 -f deploy/postgres/init.sql
--
-- It creates no tables: the controller applies its migrations (migrations/postgres/) itself
-- every time it starts, as the role created here, which owns the database and so may create
-- tables, views and functions in its public schema.
--
-- The password: leave it out of this file. Either set it afterwards, interactively,
--
--   sudo -u postgres psql -c '\password trainyard'
--
-- (psql hashes it on the client, so the clear text never reaches the server or its logs), or
-- pass it as a psql variable: add `-v trainyard_password='...'` to the command above.

-- Store a SCRAM-SHA-256 verifier, never an MD5 hash (the default only since PostgreSQL 14).
SET password_encryption = 'scram-sha-256';

\if :{?trainyard_password}
CREATE ROLE trainyard LOGIN PASSWORD :'trainyard_password';
\else
CREATE ROLE trainyard LOGIN;
\echo 'init.sql: role trainyard has no password yet; set one with: psql -c ''\\password trainyard'''
\endif

CREATE DATABASE trainyard OWNER trainyard ENCODING 'UTF8' TEMPLATE template0;
-- Only the owner (and superusers) may connect; readers get CONNECT through the role below.
REVOKE ALL ON DATABASE trainyard FROM PUBLIC;

-- Optional: a group role for people and dashboards that query the tables (docs/schema.md) but
-- must not change them. Grant it to their own login roles: GRANT trainyard_read TO alice;
CREATE ROLE trainyard_read NOLOGIN;
GRANT CONNECT ON DATABASE trainyard TO trainyard_read;

\connect trainyard
GRANT USAGE ON SCHEMA public TO trainyard_read;
-- The tables and views do not exist yet (the controller creates them on its first start):
-- default privileges make everything the trainyard role creates in public readable by the group.
ALTER DEFAULT PRIVILEGES FOR ROLE trainyard IN SCHEMA public GRANT SELECT ON TABLES TO trainyard_read;
