//! The controller's administration subcommands: the PKI, users and their tokens, the audit
//! log. They work through the core's auth service on the store (the controller may be
//! running), which writes a row of the audit log for every user or token change.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use clap::Subcommand;
use trainyard_controller::auth::{self, pki};
use trainyard_controller::core::Auth;
use trainyard_store::{StoreError, UserRecord};

use super::{Cli, Command};

#[derive(Debug, Subcommand)]
pub enum UserCommand {
    /// Add a user and print their first token (shown once; only its hash is stored).
    Add {
        name: String,
        /// Sees and cancels every job, runs preflight on nodes, may use any priority.
        #[arg(long)]
        admin: bool,
        /// The Unix account the user's ranks run as on every node (never root). Without one
        /// the user cannot submit jobs.
        #[arg(long)]
        unix_user: Option<String>,
        /// Days until the token expires (default: never).
        #[arg(long)]
        expires_days: Option<u32>,
    },
    /// Print a new token for an existing user (their other tokens stay valid).
    Token {
        name: String,
        #[arg(long)]
        expires_days: Option<u32>,
    },
    /// Revoke a user's tokens: all of them, or the one starting with --prefix.
    Revoke {
        name: String,
        #[arg(long)]
        prefix: Option<String>,
    },
    /// Change a user's Unix account or admin flag, or disable / enable them.
    Set {
        name: String,
        #[arg(long)]
        unix_user: Option<String>,
        #[arg(long)]
        admin: Option<bool>,
        #[arg(long, conflicts_with = "enable")]
        disable: bool,
        #[arg(long)]
        enable: bool,
    },
    /// List users and their tokens (prefixes only).
    List,
}

pub async fn run(command: &Command, cli: &Cli) -> anyhow::Result<()> {
    match command {
        Command::InitPki { dir, sans, agents, days } => {
            let written = pki::init(dir, sans, agents, *days)?;
            println!("wrote the CA and the controller's certificate to {}", written.dir.display());
            println!(
                "  controller: trainyard-controller --listen 0.0.0.0:7070 --tls-dir {}",
                written.dir.display()
            );
            println!(
                "  ctl:        TRAINYARD_CA={}/ca.pem ctl --controller https://HOST:7070 ...",
                written.dir.display()
            );
            for agent in &written.agents {
                println!(
                    "  agent:      copy {} to the node, then trainyard-agent --tls-dir DIR",
                    agent.display()
                );
            }
            println!("keep {}/ca.key secret: whoever holds it can make agents", written.dir.display());
            Ok(())
        }
        Command::IssueAgentCert { name, pki_dir, days } => {
            let out = pki::issue_agent(pki_dir, name, pki::Validity::days(*days))?;
            println!("{}", out.display());
            eprintln!(
                "copy this directory to node {name}, then: trainyard-agent --agent-id {name} --tls-dir DIR"
            );
            Ok(())
        }
        Command::User { action } => user(action, &open_auth(cli).await?).await,
        Command::Audit { limit } => {
            for e in open_auth(cli).await?.audit_log(*limit).await?.iter().rev() {
                let outcome = if e.accepted { "accepted" } else { "REFUSED" };
                // Actor, target and detail come from callers (refused tokens included): shown,
                // never acted on by the terminal.
                let text = |s: &str| trainyard_model::text::printable(s).into_owned();
                println!(
                    "{}  {:<8} {:<12} {:<20} {:<16} {}",
                    e.at_ms,
                    outcome,
                    text(&e.actor),
                    text(&e.action),
                    text(&e.target),
                    text(&e.detail)
                );
            }
            Ok(())
        }
    }
}

/// The auth service over the store the flags name.
async fn open_auth(cli: &Cli) -> anyhow::Result<Auth> {
    Ok(Auth::new(Arc::new(super::open_store(cli).await?)))
}

async fn user(action: &UserCommand, store: &Auth) -> anyhow::Result<()> {
    match action {
        UserCommand::Add { name, admin, unix_user, expires_days } => {
            add_user(store, name, *admin, unix_user.as_deref(), *expires_days).await
        }
        UserCommand::Token { name, expires_days } => {
            existing(store, name).await?;
            issue(store, name, *expires_days).await
        }
        UserCommand::Revoke { name, prefix } => {
            existing(store, name).await?;
            let n = store.revoke_tokens(name, prefix.as_deref(), &actor(), now_ms()).await?;
            println!("revoked {n} token(s) of {name}");
            Ok(())
        }
        UserCommand::Set { name, unix_user, admin, disable, enable } => {
            let mut user = existing(store, name).await?;
            if let Some(account) = unix_user {
                check_account(account)?;
                user.unix_user = Some(account.clone());
            }
            if let Some(admin) = admin {
                user.admin = *admin;
            }
            if *disable {
                user.disabled_at_ms = Some(now_ms());
            }
            if *enable {
                user.disabled_at_ms = None;
            }
            let detail = store.update_user(&user, &actor(), now_ms()).await?;
            println!("{name}: {detail}");
            Ok(())
        }
        UserCommand::List => list_users(store).await,
    }
}

/// `user add`: a new user, and their first token.
async fn add_user(
    store: &Auth,
    name: &str,
    admin: bool,
    unix_user: Option<&str>,
    expires_days: Option<u32>,
) -> anyhow::Result<()> {
    check_name(name)?;
    if let Some(account) = unix_user {
        check_account(account)?;
    }
    let user = UserRecord {
        name: name.to_string(),
        admin,
        unix_user: unix_user.map(str::to_string),
        created_at_ms: now_ms(),
        disabled_at_ms: None,
    };
    match store.add_user(&user, &actor()).await {
        Err(StoreError::Duplicate(_)) => {
            bail!("user {name} exists; `user token {name}` prints a new token for them")
        }
        other => other.context("store the user")?,
    }
    issue(store, name, expires_days).await
}

/// `user list`: every user with their live tokens' prefixes.
async fn list_users(store: &Auth) -> anyhow::Result<()> {
    let now = now_ms();
    for u in store.users().await? {
        let tokens = store.tokens_of(&u.name).await?;
        let live: Vec<&str> = tokens
            .iter()
            .filter(|t| t.revoked_at_ms.is_none() && t.expires_at_ms.is_none_or(|at| at > now))
            .map(|t| t.prefix.as_str())
            .collect();
        println!(
            "{:<16} admin={:<5} unix_user={:<12} {} tokens: {}",
            u.name,
            u.admin,
            u.unix_user.as_deref().unwrap_or("-"),
            if u.disabled_at_ms.is_some() { "DISABLED" } else { "enabled" },
            if live.is_empty() { "none".to_string() } else { live.join(", ") }
        );
    }
    Ok(())
}

/// Stores a new token of `name` and prints it: the only time it is ever shown.
async fn issue(store: &Auth, name: &str, expires_days: Option<u32>) -> anyhow::Result<()> {
    let now = now_ms();
    let expires = expires_days.map(|d| now + i64::from(d) * 86_400_000);
    let token = store.issue_token(name, expires, &actor(), now).await?;
    println!("{token}");
    eprintln!("the token of {name} (shown once): give it to them as TRAINYARD_TOKEN or a --token-file");
    Ok(())
}

async fn existing(store: &Auth, name: &str) -> anyhow::Result<UserRecord> {
    store
        .user(name)
        .await?
        .with_context(|| format!("find user {name}: no such user (`user list` shows them)"))
}

/// Who the audit log says made a change: the Unix user running the command.
fn actor() -> String {
    format!("cli:{}", std::env::var("USER").unwrap_or_else(|_| "?".into()))
}

fn check_name(name: &str) -> anyhow::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '@'));
    if !ok || name == auth::LOCAL_ADMIN {
        bail!(
            "user name {name:?} must be 1-64 letters, digits, '-', '_', '.' or '@', and not {:?}",
            auth::LOCAL_ADMIN
        );
    }
    Ok(())
}

/// Ranks never run as root; the agent checks the account exists on its node.
fn check_account(account: &str) -> anyhow::Result<()> {
    if account.is_empty() || account == "root" || account == "0" {
        bail!("--unix-user {account:?}: ranks never run as root; name an unprivileged account");
    }
    Ok(())
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}
