//! The auth service: users, their tokens and the audit log, in the store.
//!
//! The store keeps only a token's SHA-256: tokens are 256 random bits, so a fast hash is
//! enough (there is no password to guess), and a leaked database holds no usable token.
//! Every change to a user or a token writes a row of the audit log here, whoever asks for it:
//! `crate::auth` (a call's credential to a caller, and the audit of calls) and the admin
//! commands (`trainyard-controller user`, `audit`), which work on the store while a controller
//! may be running.

use std::sync::Arc;

use sha2::{Digest, Sha256};
use trainyard_store::{AuditEntry, Store, StoreError, TokenRecord, UserRecord};

/// Every token starts with this, so a leaked one is recognisable in logs and scanners.
pub const TOKEN_PREFIX: &str = "tyt_";

type Result<T> = std::result::Result<T, StoreError>;

/// Users, tokens and the audit log ([`crate::core::Controller::auth`], or [`Auth::new`] over a
/// store for the admin commands).
#[derive(Clone)]
pub struct Auth {
    store: Arc<dyn Store>,
}

impl Auth {
    /// The auth service over `store`.
    pub fn new(store: Arc<dyn Store>) -> Auth {
        Auth { store }
    }

    /// The user called `name`, if any.
    pub async fn user(&self, name: &str) -> Result<Option<UserRecord>> {
        self.store.get_user(name).await
    }

    /// Every user, by name.
    pub async fn users(&self) -> Result<Vec<UserRecord>> {
        self.store.list_users().await
    }

    /// The tokens of a user (hashes, prefixes, expiry, revocation).
    pub async fn tokens_of(&self, name: &str) -> Result<Vec<TokenRecord>> {
        self.store.tokens_of(name).await
    }

    /// Stores a new user (an error names a duplicate) and audits it as `actor`'s doing.
    pub async fn add_user(&self, user: &UserRecord, actor: &str) -> Result<()> {
        self.store.add_user(user).await?;
        let detail = format!("admin={} unix_user={}", user.admin, user.unix_user.as_deref().unwrap_or("-"));
        self.audit_change(actor, "user.add", &user.name, &detail, user.created_at_ms).await;
        Ok(())
    }

    /// Stores a user's new admin flag, Unix account and disabled time, and audits it; returns
    /// the audit row's detail.
    pub async fn update_user(&self, user: &UserRecord, actor: &str, at_ms: i64) -> Result<String> {
        self.store.update_user(user).await?;
        let detail = format!(
            "admin={} unix_user={} disabled={}",
            user.admin,
            user.unix_user.as_deref().unwrap_or("-"),
            user.disabled_at_ms.is_some()
        );
        self.audit_change(actor, "user.set", &user.name, &detail, at_ms).await;
        Ok(detail)
    }

    /// A new token of `name`, valid until `expires_at_ms` (none: until revoked). The token
    /// itself is returned once and never stored.
    pub async fn issue_token(
        &self,
        name: &str,
        expires_at_ms: Option<i64>,
        actor: &str,
        at_ms: i64,
    ) -> anyhow::Result<String> {
        let token = new_token()?;
        let prefix = token_prefix(&token);
        self.store.add_token(name, &token_hash(&token), &prefix, at_ms, expires_at_ms).await?;
        self.audit_change(actor, "token.add", name, &format!("token {prefix}... issued"), at_ms).await;
        Ok(token)
    }

    /// Revokes the tokens of `name` (only those starting with `prefix`, when given); returns
    /// how many.
    pub async fn revoke_tokens(
        &self,
        name: &str,
        prefix: Option<&str>,
        actor: &str,
        at_ms: i64,
    ) -> Result<u64> {
        let n = self.store.revoke_tokens(name, prefix, at_ms).await?;
        self.audit_change(actor, "token.revoke", name, &format!("{n} token(s) revoked"), at_ms).await;
        Ok(n)
    }

    /// The token with this SHA-256 (hex) and its user, if the store has it.
    pub async fn token_owner(&self, hash: &str) -> Result<Option<(TokenRecord, UserRecord)>> {
        self.store.token_owner(hash).await
    }

    /// The hashes of every stored token (revoked and expired ones included).
    pub async fn token_hashes(&self) -> Result<Vec<String>> {
        self.store.token_hashes().await
    }

    /// Writes one row of the audit log.
    pub async fn audit(&self, entry: &AuditEntry) -> Result<()> {
        self.store.audit(entry).await
    }

    /// The newest `limit` rows of the audit log, newest first.
    pub async fn audit_log(&self, limit: u32) -> Result<Vec<AuditEntry>> {
        self.store.audit_log(limit).await
    }

    /// Audits an accepted change to user `name`; a failure is logged, not returned: the change
    /// already happened.
    async fn audit_change(&self, actor: &str, action: &str, name: &str, detail: &str, at_ms: i64) {
        let entry = AuditEntry {
            at_ms,
            actor: actor.into(),
            action: action.into(),
            target: format!("user:{name}"),
            accepted: true,
            detail: detail.into(),
        };
        if let Err(e) = self.store.audit(&entry).await {
            tracing::error!(actor, action, name, error = %e, "failed to write the audit log");
        }
    }
}

/// A new random token (`tyt_` and 64 hex digits).
pub fn new_token() -> anyhow::Result<String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("read random bytes for a token: {e}"))?;
    Ok(format!("{TOKEN_PREFIX}{}", hex(&bytes)))
}

/// The hex SHA-256 of a token: what the store keeps.
pub fn token_hash(token: &str) -> String {
    hex(&Sha256::digest(token.as_bytes()))
}

/// The first characters of a token, stored to tell a user's tokens apart.
pub fn token_prefix(token: &str) -> String {
    token.chars().take(TOKEN_PREFIX.len() + 8).collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
