//! Who is calling, and what they may do.
//!
//! - Users (`ctl`, the web view) present a bearer token; the core's auth service
//!   ([`crate::core::Auth`]) keeps only its SHA-256.
//! - Agents present a client certificate signed by the fleet's CA; its common name is the
//!   agent id (checked in `service::agents`).
//! - The loopback demo (plaintext, loopback only) needs no setup: a call without a token acts
//!   as the local admin [`LOCAL_ADMIN`], created at start.
//!
//! # Layout
//! - `pki`: the CA and certificates `init-pki` writes.
//! - [`door`]: addresses that flood the controller with refused calls are turned away at accept.
//! - this module: the [`Policy`], [`Authenticator`] (token to [`Caller`], through the auth
//!   service), the permission rules, and the audit of calls.

mod budget;
pub mod door;
pub mod peer;
pub mod pki;

use std::sync::Arc;

use crate::core::Auth;
pub use crate::core::auth::{TOKEN_PREFIX, new_token, token_hash, token_prefix};
use budget::RefusalBudget;
use trainyard_store::{AuditEntry, JobOwner, StoreError, UserRecord};

/// The user a tokenless call acts as in the loopback demo.
pub const LOCAL_ADMIN: &str = "local";

/// How the controller authenticates its callers, from how it listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Users must present a valid token; false: a tokenless call acts as [`LOCAL_ADMIN`].
    pub require_user_token: bool,
    /// Agents must present a client certificate whose common name is their id.
    pub require_agent_cert: bool,
    /// Highest job priority a non-admin may submit.
    pub max_user_priority: i32,
}

impl Policy {
    /// Plaintext on loopback: the no-setup demo.
    pub fn demo() -> Self {
        Policy { require_user_token: false, require_agent_cert: false, max_user_priority: i32::MAX }
    }

    /// TLS with client certificates for agents and tokens for users.
    pub fn secure(max_user_priority: i32) -> Self {
        Policy { require_user_token: true, require_agent_cert: true, max_user_priority }
    }
}

/// An authenticated user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub name: String,
    pub admin: bool,
    /// The Unix account this user's ranks run as.
    pub unix_user: Option<String>,
}

impl Caller {
    /// May this caller see, watch, read the logs of and cancel a job of `owner`? Jobs stored
    /// before users existed (no owner) are the admins'.
    pub fn may_access(&self, owner: &JobOwner) -> bool {
        self.admin || (!owner.user.is_empty() && owner.user == self.name)
    }
}

/// Why a call was refused.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    PermissionDenied(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Longest value of an audit row's field; longer ones (a 4 MiB job name in a refused submit)
/// are cut, with their length noted, so a flood of large refused calls cannot fill the disk.
pub const MAX_AUDIT_FIELD_BYTES: usize = 256;

/// Refused calls without a valid credential written to `audit_log` per second (after a burst of
/// [`AUDIT_REFUSALS_BURST`]); the rest are counted and written as one summary row, so a flood of
/// bad tokens neither grows the table without bound nor takes the store's connections from
/// receipt ingest.
pub const AUDIT_REFUSALS_PER_SEC: f64 = 1.0;
pub const AUDIT_REFUSALS_BURST: f64 = 20.0;

/// How often a token missing from the set of known token hashes reloads the set.
pub const KNOWN_TOKENS_REFRESH: std::time::Duration = std::time::Duration::from_secs(1);

/// Lookups a second of tokens missing from a set loaded less than [`KNOWN_TOKENS_REFRESH`] ago
/// (a token made a moment ago by `user add` or `user token` is one); past them, during a flood
/// of made-up tokens, a missing token is refused without a query.
pub const UNKNOWN_TOKEN_LOOKUPS_PER_SEC: f64 = 20.0;

/// Longest `authorization` value looked up at all: a token is `tyt_` and 64 hex digits.
const MAX_TOKEN_BYTES: usize = 128;

/// Turns a call's bearer token into a [`Caller`], and writes the audit log.
#[derive(Clone)]
pub struct Authenticator {
    accounts: Auth,
    policy: Policy,
    refusals: Arc<std::sync::Mutex<RefusalBudget>>,
    known: Arc<std::sync::Mutex<KnownTokens>>,
    /// Set while one caller reloads the known set (outside the lock above); callers that miss
    /// meanwhile wait for `reloaded`.
    reloading: Arc<std::sync::atomic::AtomicBool>,
    reloaded: Arc<tokio::sync::Notify>,
    door: Arc<door::Door>,
}

/// The hashes of every token in the store, and when they were read. A token found here is
/// still looked up (revocation, expiry and disabled users apply at once); one not found is
/// refused without a query unless the set is older than [`KNOWN_TOKENS_REFRESH`].
struct KnownTokens {
    hashes: std::collections::HashSet<String>,
    loaded_at: Option<std::time::Instant>,
    /// Lookups of missing tokens between reloads.
    lookups: RefusalBudget,
}

/// `text` cut to [`MAX_AUDIT_FIELD_BYTES`] on a character boundary, its full length noted.
pub fn clip(text: &str) -> String {
    clip_to(text, MAX_AUDIT_FIELD_BYTES)
}

/// `text` cut to about `max` bytes on a character boundary, its full length noted.
pub fn clip_to(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes)", &text[..end], text.len())
}

impl Authenticator {
    pub fn new(accounts: Auth, policy: Policy) -> Self {
        let budget = RefusalBudget::new(AUDIT_REFUSALS_PER_SEC, AUDIT_REFUSALS_BURST);
        Authenticator {
            accounts,
            policy,
            refusals: Arc::new(std::sync::Mutex::new(budget)),
            door: Arc::default(),
            reloading: Arc::default(),
            reloaded: Arc::default(),
            known: Arc::new(std::sync::Mutex::new(KnownTokens {
                hashes: Default::default(),
                loaded_at: None,
                lookups: RefusalBudget::new(UNKNOWN_TOKEN_LOOKUPS_PER_SEC, UNKNOWN_TOKEN_LOOKUPS_PER_SEC),
            })),
        }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The door this authenticator reports refused calls to, for the listeners to consult at
    /// accept.
    pub fn door(&self) -> Arc<door::Door> {
        self.door.clone()
    }

    /// The same authenticator under another policy (the HTTP listener off loopback, where every
    /// call needs a token): one door, one audit budget, one set of known tokens.
    pub fn with_policy(&self, policy: Policy) -> Authenticator {
        Authenticator { policy, ..self.clone() }
    }

    /// A call from `peer` was refused for want of a valid credential: the door counts it, and
    /// the log says once when the address becomes limited.
    pub fn note_refused(&self, peer: std::net::IpAddr, at_ms: i64) {
        if self.door.refused(peer, at_ms) == door::Verdict::NowLimited {
            tracing::warn!(
                address = %peer,
                burst = door::REFUSALS_BURST,
                "an address keeps calling without a valid credential: its new connections are limited to {}/s until it stops for {} s",
                door::ACCEPTS_PER_SEC_WHEN_LIMITED,
                door::LIMITED_FOR_MS / 1000
            );
        }
    }

    /// A call without a token from `peer`: in the loopback demo it acts as the local admin only
    /// when it comes from the account that started this controller ([`peer::is_own_account`]);
    /// from any other account on the host it is refused, saying so.
    pub fn tokenless_from(&self, peer: Option<std::net::SocketAddr>) -> Result<(), AuthError> {
        if self.policy.require_user_token || peer::is_own_account(peer) {
            return Ok(());
        }
        // SAFETY: geteuid cannot fail.
        let me = unsafe { libc::geteuid() };
        Err(AuthError::Unauthenticated(format!(
            "this loopback demo controller answers calls without a token only from the account that started it \
             (uid {me}); pass a token (TRAINYARD_TOKEN or --token-file) or ask its owner"
        )))
    }

    /// Creates the demo's local admin when this policy lets tokenless calls in.
    pub async fn ensure_local_admin(&self, now_ms: i64) -> Result<(), StoreError> {
        if self.policy.require_user_token || self.accounts.user(LOCAL_ADMIN).await?.is_some() {
            return Ok(());
        }
        let user = UserRecord {
            name: LOCAL_ADMIN.into(),
            admin: true,
            unix_user: None,
            created_at_ms: now_ms,
            disabled_at_ms: None,
        };
        match self.accounts.add_user(&user, "controller").await {
            Ok(()) | Err(StoreError::Duplicate(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The caller a bearer token (the `authorization` header's value, if any) stands for.
    pub async fn user(&self, authorization: Option<&str>, now_ms: i64) -> Result<Caller, AuthError> {
        let token = match authorization {
            None | Some("") if !self.policy.require_user_token => {
                return Ok(Caller { name: LOCAL_ADMIN.into(), admin: true, unix_user: None });
            }
            None | Some("") => {
                return Err(AuthError::Unauthenticated(
                    "no token: pass one with TRAINYARD_TOKEN or --token-file (an admin creates it with \
                     `trainyard-controller user add NAME`)"
                        .into(),
                ));
            }
            Some(value) => value.strip_prefix("Bearer ").unwrap_or(value).trim(),
        };
        // Nothing that cannot be a token costs a database lookup.
        if token.len() > MAX_TOKEN_BYTES || !token.starts_with(TOKEN_PREFIX) {
            return Err(AuthError::Unauthenticated(format!(
                "the token is not valid: a trainyard token starts with {TOKEN_PREFIX} and is 68 characters long"
            )));
        }
        let hash = token_hash(token);
        if !self.may_exist(&hash, now_ms).await? {
            return Err(AuthError::Unauthenticated(
                "the token is not valid: unknown to this controller".into(),
            ));
        }
        let Some((t, user)) = self.accounts.token_owner(&hash).await? else {
            return Err(AuthError::Unauthenticated(
                "the token is not valid: unknown to this controller".into(),
            ));
        };
        if t.revoked_at_ms.is_some() {
            return Err(AuthError::Unauthenticated(format!(
                "the token {}... of {} was revoked; ask an admin for a new one",
                t.prefix, user.name
            )));
        }
        if t.expires_at_ms.is_some_and(|at| at <= now_ms) {
            return Err(AuthError::Unauthenticated(format!(
                "the token {}... of {} has expired; ask an admin for a new one",
                t.prefix, user.name
            )));
        }
        if user.disabled_at_ms.is_some() {
            return Err(AuthError::Unauthenticated(format!("user {} is disabled", user.name)));
        }
        Ok(Caller { name: user.name, admin: user.admin, unix_user: user.unix_user })
    }

    /// Whether a token with this hash may be in the store: in the known set; or in it after a
    /// reload (at most once per [`KNOWN_TOKENS_REFRESH`]); or, between reloads, worth a lookup
    /// while fewer than [`UNKNOWN_TOKEN_LOOKUPS_PER_SEC`] were. No lock is held across the
    /// reload's query: a token in the set never waits; of the callers that miss a stale set, one
    /// reloads and the others wait for it, then look again.
    async fn may_exist(&self, hash: &str, now_ms: i64) -> Result<bool, StoreError> {
        use std::sync::atomic::Ordering;
        loop {
            {
                let mut known = self.known();
                if known.hashes.contains(hash) {
                    return Ok(true);
                }
                if known.loaded_at.is_some_and(|at| at.elapsed() < KNOWN_TOKENS_REFRESH) {
                    return Ok(known.lookups.take(now_ms));
                }
            }
            let reloaded = self.reloaded.notified();
            tokio::pin!(reloaded);
            reloaded.as_mut().enable();
            if self.reloading.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_err() {
                reloaded.await;
                continue;
            }
            /// Ends the reload however it ends (an error, or the call being dropped): clears the
            /// flag and wakes the callers waiting for it.
            struct Reloading<'a>(&'a Authenticator);
            impl Drop for Reloading<'_> {
                fn drop(&mut self) {
                    self.0.reloading.store(false, Ordering::Release);
                    self.0.reloaded.notify_waiters();
                }
            }
            let _reloading = Reloading(self);
            let hashes: std::collections::HashSet<String> =
                self.accounts.token_hashes().await?.into_iter().collect();
            let mut known = self.known();
            known.hashes = hashes;
            known.loaded_at = Some(std::time::Instant::now());
            return Ok(known.hashes.contains(hash));
        }
    }

    fn known(&self) -> std::sync::MutexGuard<'_, KnownTokens> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes one audit row; a failure is logged, never returned: the action already happened
    /// (or was already refused).
    pub async fn audit(
        &self,
        actor: &str,
        action: &str,
        target: &str,
        outcome: Result<&str, &str>,
        at_ms: i64,
    ) {
        let (accepted, detail) = match outcome {
            Ok(d) => (true, d),
            Err(d) => (false, d),
        };
        let entry = AuditEntry {
            at_ms,
            actor: clip(actor),
            action: clip(action),
            target: clip(target),
            accepted,
            detail: clip(detail),
        };
        if let Err(e) = self.accounts.audit(&entry).await {
            tracing::error!(actor, action, target, error = %e, "failed to write the audit log");
        }
    }
}

impl Authenticator {
    /// Audits a call refused for want of a valid credential, at most
    /// [`AUDIT_REFUSALS_PER_SEC`] rows a second; the first row after a dry spell says how many
    /// were left out.
    /// The log gets the same lines at the same rate (`peer`: where the call came from), so a
    /// flood fills neither the table nor the log.
    pub async fn audit_refusal(
        &self,
        action: &str,
        target: &str,
        why: &str,
        peer: Option<std::net::SocketAddr>,
        at_ms: i64,
    ) {
        if let Some(peer) = peer {
            self.note_refused(peer.ip(), at_ms);
        }
        let (write, suppressed) = {
            let mut budget = self.refusals.lock().unwrap_or_else(|p| p.into_inner());
            let write = budget.take(at_ms);
            let suppressed = if write { std::mem::take(&mut budget.suppressed) } else { 0 };
            (write, suppressed)
        };
        if !write {
            return;
        }
        if suppressed > 0 {
            let note = format!(
                "{suppressed} more refused calls without a valid credential were not audited one by one (rate limit)"
            );
            tracing::warn!(
                suppressed,
                "refused calls without a valid credential not logged one by one (rate limit)"
            );
            self.audit("-", "audit.rate_limited", "-", Err(&note), at_ms).await;
        }
        let target = clip(target);
        tracing::warn!(action, target, ?peer, reason = %why, "call refused: no valid credential");
        self.audit("-", action, &target, Err(why), at_ms).await;
    }
}

/// Who owns a job `caller` submits, or why they may not submit it.
pub fn owner_for_submit(caller: &Caller, policy: &Policy, priority: i32) -> Result<JobOwner, AuthError> {
    if !caller.admin && priority > policy.max_user_priority {
        return Err(AuthError::PermissionDenied(format!(
            "priority {priority} is above {}, the highest a non-admin may ask for",
            policy.max_user_priority
        )));
    }
    let run_as = match (&caller.unix_user, policy.require_user_token) {
        (Some(account), _) => account.clone(),
        // The demo's ranks run as the agent's own (non-root) account.
        (None, false) => String::new(),
        (None, true) => {
            return Err(AuthError::PermissionDenied(format!(
                "user {} has no Unix account to run ranks as; an admin sets one with \
                 `trainyard-controller user set {} --unix-user ACCOUNT`",
                caller.name, caller.name
            )));
        }
    };
    Ok(JobOwner { user: caller.name.clone(), run_as })
}

#[cfg(test)]
mod tests;
