//! The authenticator against a real store: tokens, users, refusals and the audit log.

use super::*;
use trainyard_store::{SqlStore, Store};

#[test]
fn tokens_are_random_prefixed_and_hashed() {
    let (a, b) = (new_token().unwrap(), new_token().unwrap());
    assert_ne!(a, b);
    assert!(a.starts_with(TOKEN_PREFIX) && a.len() == TOKEN_PREFIX.len() + 64, "{a}");
    assert_eq!(token_hash(&a), token_hash(&a));
    assert_ne!(token_hash(&a), token_hash(&b));
    assert_eq!(token_hash("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    assert_eq!(token_prefix(&a).len(), TOKEN_PREFIX.len() + 8);
}

#[test]
fn audit_fields_are_clipped_at_the_limit() {
    let at = "a".repeat(MAX_AUDIT_FIELD_BYTES);
    assert_eq!(clip(&at), at, "at the limit: kept whole");
    let over = "a".repeat(MAX_AUDIT_FIELD_BYTES + 1);
    let clipped = clip(&over);
    assert!(clipped.starts_with(&at) && clipped.ends_with(&format!("({} bytes)", MAX_AUDIT_FIELD_BYTES + 1)));
    // Never inside a character.
    let wide = "é".repeat(MAX_AUDIT_FIELD_BYTES);
    assert!(clip(&wide).len() < MAX_AUDIT_FIELD_BYTES + 20);
}

#[test]
fn refused_calls_are_audited_at_a_bounded_rate() {
    let mut budget = RefusalBudget::new(AUDIT_REFUSALS_PER_SEC, AUDIT_REFUSALS_BURST);
    let burst = AUDIT_REFUSALS_BURST as usize;
    assert_eq!((0..burst).filter(|_| budget.take(0)).count(), burst, "the burst is written");
    assert!(!budget.take(0), "one more at the same instant is not");
    assert_eq!(budget.suppressed, 1);
    // A second later, AUDIT_REFUSALS_PER_SEC more are written, and no more.
    let per_sec = AUDIT_REFUSALS_PER_SEC as usize;
    assert_eq!((0..per_sec * 3).filter(|_| budget.take(1_000)).count(), per_sec);
}

#[tokio::test]
async fn a_flood_of_refusals_writes_a_bounded_number_of_rows_and_says_how_many_it_left_out() {
    let store: Arc<dyn Store> = Arc::new(SqlStore::sqlite_in_memory().await.unwrap());
    let auth = Authenticator::new(crate::core::Auth::new(store.clone()), Policy::secure(0));
    let huge = "x".repeat(4 << 20);
    for i in 0..1_000 {
        auth.audit_refusal("job.submit", &huge, "the token is not valid", None, i).await;
    }
    // One more, two seconds later: it carries the count of those left out.
    auth.audit_refusal("job.submit", "job:new", "the token is not valid", None, 3_000).await;
    let rows = store.audit_log(10_000).await.unwrap();
    // The burst, then about AUDIT_REFUSALS_PER_SEC a second over the 3 s (each after a
    // dry spell with its summary row): about 120 rows at most for 1,001 refusals.
    let burst = AUDIT_REFUSALS_BURST as usize;
    let most = burst + 2 * (3 * AUDIT_REFUSALS_PER_SEC as usize + 1);
    assert!((burst..=most).contains(&rows.len()), "{} rows", rows.len());
    assert!(rows.iter().all(|r| r.target.len() < MAX_AUDIT_FIELD_BYTES + 20));
    assert!(rows.iter().any(|r| r.action == "audit.rate_limited" && r.detail.contains("more refused calls")));
}

/// An in-memory store with one user, `ann`, and no tokens.
async fn store_with_ann() -> Arc<dyn Store> {
    let store: Arc<dyn Store> = Arc::new(SqlStore::sqlite_in_memory().await.unwrap());
    let user = UserRecord {
        name: "ann".into(),
        admin: false,
        unix_user: None,
        created_at_ms: 0,
        disabled_at_ms: None,
    };
    store.add_user(&user).await.unwrap();
    store
}

/// The set of known token hashes never keeps a new token out: one made right after the set
/// was read works at once (looked up while lookups of unknown tokens are few).
#[tokio::test]
async fn a_token_made_a_moment_ago_works_at_once() {
    let store = store_with_ann().await;
    let auth = Authenticator::new(crate::core::Auth::new(store.clone()), Policy::secure(0));
    let unknown = format!("Bearer {}", new_token().unwrap());
    assert!(auth.user(Some(&unknown), 0).await.is_err(), "reads the set");
    let token = new_token().unwrap();
    store.add_token("ann", &token_hash(&token), &token_prefix(&token), 1, None).await.unwrap();
    let caller = auth.user(Some(&format!("Bearer {token}")), 2).await.expect("a new token works");
    assert_eq!(caller.name, "ann");
}

/// Many callers with valid tokens at once on a cold set (a controller just started): one
/// reloads the set, the others wait for it rather than spend the lookups of unknown tokens.
#[tokio::test]
async fn many_valid_tokens_at_once_on_a_cold_set_all_get_in() {
    let store = store_with_ann().await;
    let token = new_token().unwrap();
    store.add_token("ann", &token_hash(&token), &token_prefix(&token), 1, None).await.unwrap();
    let auth = Authenticator::new(crate::core::Auth::new(store), Policy::secure(0));
    let header = format!("Bearer {token}");
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..3 * UNKNOWN_TOKEN_LOOKUPS_PER_SEC as usize {
        let (auth, header) = (auth.clone(), header.clone());
        calls.spawn(async move { auth.user(Some(&header), 2).await });
    }
    while let Some(result) = calls.join_next().await {
        assert_eq!(result.unwrap().expect("a valid token gets in").name, "ann");
    }
}

#[tokio::test]
async fn what_cannot_be_a_token_is_refused_without_a_lookup() {
    let store: Arc<dyn Store> = Arc::new(SqlStore::sqlite_in_memory().await.unwrap());
    let auth = Authenticator::new(crate::core::Auth::new(store), Policy::secure(0));
    for bad in ["Bearer nope".to_string(), format!("Bearer tyt_{}", "0".repeat(200))] {
        let e = auth.user(Some(&bad), 0).await.unwrap_err();
        assert!(e.to_string().contains("starts with tyt_"), "{e}");
    }
}

#[test]
fn owners_and_admins_reach_jobs_others_do_not() {
    let alice = Caller { name: "alice".into(), admin: false, unix_user: Some("alice".into()) };
    let root = Caller { name: "ops".into(), admin: true, unix_user: None };
    let of = |u: &str| JobOwner { user: u.into(), run_as: String::new() };
    assert!(alice.may_access(&of("alice")));
    assert!(!alice.may_access(&of("bob")));
    assert!(!alice.may_access(&of("")));
    assert!(root.may_access(&of("bob")) && root.may_access(&of("")));
}

#[test]
fn submit_needs_a_unix_account_and_a_priority_within_the_ceiling() {
    let policy = Policy::secure(10);
    let alice = Caller { name: "alice".into(), admin: false, unix_user: Some("u-alice".into()) };
    assert_eq!(owner_for_submit(&alice, &policy, 10).unwrap().run_as, "u-alice");
    let high = owner_for_submit(&alice, &policy, 11).unwrap_err().to_string();
    assert!(high.contains("above 10"), "{high}");
    let admin = Caller { name: "ops".into(), admin: true, unix_user: Some("ops".into()) };
    assert!(owner_for_submit(&admin, &policy, 100).is_ok());
    let unmapped = Caller { unix_user: None, ..alice.clone() };
    let why = owner_for_submit(&unmapped, &policy, 0).unwrap_err().to_string();
    assert!(why.contains("no Unix account"), "{why}");
    assert_eq!(owner_for_submit(&unmapped, &Policy::demo(), 0).unwrap().run_as, "");
}

#[tokio::test]
async fn tokens_authenticate_until_revoked_or_expired() {
    let store: Arc<dyn Store> = Arc::new(SqlStore::sqlite_in_memory().await.unwrap());
    let auth = Authenticator::new(crate::core::Auth::new(store.clone()), Policy::secure(0));
    let user = UserRecord {
        name: "alice".into(),
        admin: false,
        unix_user: Some("alice".into()),
        created_at_ms: 1,
        disabled_at_ms: None,
    };
    store.add_user(&user).await.unwrap();
    let token = new_token().unwrap();
    store.add_token("alice", &token_hash(&token), &token_prefix(&token), 1, Some(1_000)).await.unwrap();
    let bearer = format!("Bearer {token}");
    assert_eq!(auth.user(Some(&bearer), 10).await.unwrap().name, "alice");
    let expired = auth.user(Some(&bearer), 1_000).await.unwrap_err().to_string();
    assert!(expired.contains("expired"), "{expired}");
    assert!(auth.user(None, 10).await.unwrap_err().to_string().starts_with("no token"));
    assert!(auth.user(Some("Bearer tyt_nope"), 10).await.unwrap_err().to_string().contains("not valid"));
    // The token limit (128 bytes): at it a value is looked up (and is unknown); one past it is
    // refused as no token at all, without a lookup.
    let at_limit = format!("{TOKEN_PREFIX}{}", "a".repeat(super::MAX_TOKEN_BYTES - TOKEN_PREFIX.len()));
    let past = format!("{at_limit}a");
    assert!(
        auth.user(Some(&at_limit), 10).await.unwrap_err().to_string().contains("unknown to this controller")
    );
    assert!(auth.user(Some(&past), 10).await.unwrap_err().to_string().contains("starts with tyt_"));
    assert_eq!(store.revoke_tokens("alice", None, 20).await.unwrap(), 1);
    assert!(auth.user(Some(&bearer), 30).await.unwrap_err().to_string().contains("revoked"));
    // The demo lets tokenless calls in as the local admin, but still checks a token given.
    let demo = Authenticator::new(crate::core::Auth::new(store.clone()), Policy::demo());
    demo.ensure_local_admin(5).await.unwrap();
    demo.ensure_local_admin(6).await.unwrap();
    assert!(store.get_user(LOCAL_ADMIN).await.unwrap().unwrap().admin);
    assert_eq!(demo.user(None, 10).await.unwrap().name, LOCAL_ADMIN);
    assert!(demo.user(Some(&bearer), 30).await.is_err());
    demo.audit("alice", "job.cancel", "job:3", Err("not yours"), 40).await;
    let log = store.audit_log(10).await.unwrap();
    assert_eq!(
        (log[0].action.as_str(), log[0].accepted, log[0].detail.as_str()),
        ("job.cancel", false, "not yours")
    );
}
