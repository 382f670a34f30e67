//! [`AuthStore`]: users, their API tokens, and the audit log.

use async_trait::async_trait;

use crate::rows::{self, duplicate_or};
use crate::{AuditEntry, AuthStore, Result, SqlStore, TokenRecord, UserRecord};

#[async_trait]
impl AuthStore for SqlStore {
    async fn add_user(&self, user: &UserRecord) -> Result<()> {
        self.write("add_user", async |c| {
            c.query(
                "INSERT INTO users (name, admin, unix_user, created_at_ms, disabled_at_ms) VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(user.name.as_str())
            .bind(user.admin)
            .bind(user.unix_user.as_deref())
            .bind(user.created_at_ms)
            .bind(user.disabled_at_ms)
            .execute()
            .await
            .map_err(duplicate_or)?;
            Ok(())
        })
        .await
    }

    async fn update_user(&self, user: &UserRecord) -> Result<bool> {
        self.write("update_user", async |c| {
            let changed = c
                .query("UPDATE users SET admin = $2, unix_user = $3, disabled_at_ms = $4 WHERE name = $1")
                .bind(user.name.as_str())
                .bind(user.admin)
                .bind(user.unix_user.as_deref())
                .bind(user.disabled_at_ms)
                .execute()
                .await?;
            Ok(changed > 0)
        })
        .await
    }

    async fn get_user(&self, name: &str) -> Result<Option<UserRecord>> {
        self.read("get_user", async |c| {
            let row = c
                .query(
                    "SELECT name, admin, unix_user, created_at_ms, disabled_at_ms FROM users WHERE name = $1",
                )
                .bind(name)
                .optional()
                .await?;
            row.map(|r| rows::user(&r, "created_at_ms")).transpose()
        })
        .await
    }

    async fn list_users(&self) -> Result<Vec<UserRecord>> {
        self.read("list_users", async |c| {
            let found = c
                .query(
                    "SELECT name, admin, unix_user, created_at_ms, disabled_at_ms FROM users ORDER BY name",
                )
                .all()
                .await?;
            found.iter().map(|r| rows::user(r, "created_at_ms")).collect()
        })
        .await
    }

    async fn add_token(
        &self,
        user: &str,
        sha256_hex: &str,
        prefix: &str,
        now_ms: i64,
        expires_at_ms: Option<i64>,
    ) -> Result<i64> {
        self.write("add_token", async |c| {
            let row = c
                .query(
                    "INSERT INTO api_tokens (user_name, token_sha256, prefix, created_at_ms, expires_at_ms) \
                     VALUES ($1, $2, $3, $4, $5) RETURNING id",
                )
                .bind(user)
                .bind(sha256_hex)
                .bind(prefix)
                .bind(now_ms)
                .bind(expires_at_ms)
                .one()
                .await
                .map_err(duplicate_or)?;
            row.get("api_tokens", "id")
        })
        .await
    }

    async fn revoke_tokens(&self, user: &str, prefix: Option<&str>, now_ms: i64) -> Result<u64> {
        self.write("revoke_tokens", async |c| {
            Ok(c.query(
                "UPDATE api_tokens SET revoked_at_ms = $3 WHERE user_name = $1 AND revoked_at_ms IS NULL \
                 AND (CAST($2 AS TEXT) IS NULL OR prefix = $2)",
            )
            .bind(user)
            .bind(prefix)
            .bind(now_ms)
            .execute()
            .await?)
        })
        .await
    }

    async fn tokens_of(&self, user: &str) -> Result<Vec<TokenRecord>> {
        self.read("tokens_of", async |c| {
            let found = c
                .query(
                    "SELECT id, user_name, prefix, created_at_ms, expires_at_ms, revoked_at_ms FROM api_tokens \
                     WHERE user_name = $1 ORDER BY id DESC",
                )
                .bind(user)
                .all()
                .await?;
            found.iter().map(rows::token).collect()
        })
        .await
    }

    async fn token_owner(&self, sha256_hex: &str) -> Result<Option<(TokenRecord, UserRecord)>> {
        self.read("token_owner", async |c| {
            let row = c
                .query(
                    "SELECT t.id, t.user_name, t.prefix, t.created_at_ms, t.expires_at_ms, t.revoked_at_ms, \
                     u.name, u.admin, u.unix_user, u.created_at_ms AS user_created_at_ms, u.disabled_at_ms \
                     FROM api_tokens t JOIN users u ON u.name = t.user_name WHERE t.token_sha256 = $1",
                )
                .bind(sha256_hex)
                .optional()
                .await?;
            let Some(row) = row else { return Ok(None) };
            Ok(Some((rows::token(&row)?, rows::user(&row, "user_created_at_ms")?)))
        })
        .await
    }

    async fn token_hashes(&self) -> Result<Vec<String>> {
        self.read("token_hashes", async |c| {
            let found = c.query("SELECT token_sha256 FROM api_tokens").all().await?;
            found.iter().map(|row| row.get("api_tokens", "token_sha256")).collect()
        })
        .await
    }

    async fn secret(&self, name: &str, fresh: &str, now_ms: i64) -> Result<String> {
        self.write("secret", async |c| {
            c.query(
                "INSERT INTO controller_secrets (name, value, created_at_ms) VALUES ($1, $2, $3) \
                 ON CONFLICT (name) DO NOTHING",
            )
            .bind(name)
            .bind(fresh)
            .bind(now_ms)
            .execute()
            .await?;
            let row =
                c.query("SELECT value FROM controller_secrets WHERE name = $1").bind(name).one().await?;
            row.get("controller_secrets", "value")
        })
        .await
    }

    async fn audit(&self, entry: &AuditEntry) -> Result<()> {
        self.write("audit", async |c| {
            c.query(
                "INSERT INTO audit_log (at_ms, actor, action, target, outcome, detail) VALUES ($1, $2, $3, $4, $5, $6)",
            )
            .bind(entry.at_ms)
            .bind(entry.actor.as_str())
            .bind(entry.action.as_str())
            .bind(entry.target.as_str())
            .bind(if entry.accepted { "accepted" } else { "refused" })
            .bind(entry.detail.as_str())
            .execute()
            .await?;
            Ok(())
        })
        .await
    }

    async fn audit_log(&self, limit: u32) -> Result<Vec<AuditEntry>> {
        self.read("audit_log", async |c| {
            let found = c
                .query("SELECT at_ms, actor, action, target, outcome, detail FROM audit_log ORDER BY id DESC LIMIT $1")
                .bind(i64::from(limit))
                .all()
                .await?;
            let t = "audit_log";
            found
                .iter()
                .map(|r| {
                    Ok(AuditEntry {
                        at_ms: r.get(t, "at_ms")?,
                        actor: r.get(t, "actor")?,
                        action: r.get(t, "action")?,
                        target: r.get(t, "target")?,
                        accepted: r.get::<String>(t, "outcome")? == "accepted",
                        detail: r.get(t, "detail")?,
                    })
                })
                .collect()
        })
        .await
    }
}
