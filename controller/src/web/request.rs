//! What the web view's handlers share: the caller of a request, query strings parsed and
//! bounded, and refusals as one line of text with a 4xx status.

use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::auth::{AuthError, Authenticator, Caller};
use crate::core::Controller;
use trainyard_store::JobRecord;

/// What the handlers share.
#[derive(Clone)]
pub struct Web {
    pub(super) controller: Arc<Controller>,
    pub(super) auth: Authenticator,
}

impl Web {
    /// The caller of a request, from its `Authorization` header.
    pub(super) async fn caller(&self, headers: &HeaderMap) -> Result<Caller, Reject> {
        let header = headers.get(header::AUTHORIZATION).map(|v| v.to_str().unwrap_or("?"));
        match self.auth.user(header, self.controller.now_ms()).await {
            Ok(caller) => Ok(caller),
            Err(AuthError::Unauthenticated(why)) => Err(reject(StatusCode::UNAUTHORIZED, why)),
            Err(AuthError::PermissionDenied(why)) => Err(reject(StatusCode::FORBIDDEN, why)),
            Err(AuthError::Store(e)) => Err(store_error(e.into())),
        }
    }

    /// The job, if `caller` may see it: 404 when unknown, 403 when it is someone else's.
    pub(super) async fn job_for(&self, caller: &Caller, raw: &str) -> Result<JobRecord, Reject> {
        let id = job_id(raw)?;
        let job = self.controller.jobs().record(id).await.map_err(store_error)?;
        let job = job.ok_or_else(|| reject(StatusCode::NOT_FOUND, format!("job {id} not found")))?;
        if !caller.may_access(&job.owner) {
            return Err(reject(
                StatusCode::FORBIDDEN,
                format!("job {id} is not yours; only its owner or an admin may see it"),
            ));
        }
        Ok(job)
    }
}

/// A refused request: its status and one line of text (small, unlike a `Response`, so the
/// helpers' `Result`s stay small).
#[derive(Debug)]
pub(super) struct Reject {
    status: StatusCode,
    message: String,
}

impl IntoResponse for Reject {
    fn into_response(self) -> Response {
        let mut message = self.message;
        message.push('\n');
        (self.status, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], message).into_response()
    }
}

pub(super) fn reject(status: StatusCode, message: impl Into<String>) -> Reject {
    Reject { status, message: message.into() }
}

/// A 4xx or 5xx with a one-line message.
pub(super) fn error(status: StatusCode, message: impl Into<String>) -> Response {
    reject(status, message).into_response()
}

/// A controller error as the gRPC service would say it, with the matching HTTP status.
pub(super) fn store_error(e: crate::core::ControllerError) -> Reject {
    let status = crate::service::to_status(e);
    let code = match status.code() {
        tonic::Code::NotFound => StatusCode::NOT_FOUND,
        tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition => StatusCode::BAD_REQUEST,
        tonic::Code::PermissionDenied => StatusCode::FORBIDDEN,
        tonic::Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    reject(code, status.message())
}

/// Longest query string the API reads; every parameter it knows is a few digits or a word.
pub const MAX_QUERY_BYTES: usize = 4_096;

/// Query parameters as `(name, value)` pairs; a malformed or over-long string is a 400 naming it.
pub(super) fn query_pairs(raw: &Option<String>) -> Result<Vec<(String, String)>, Reject> {
    let Some(raw) = raw else { return Ok(Vec::new()) };
    if raw.len() > MAX_QUERY_BYTES {
        return Err(reject(
            StatusCode::BAD_REQUEST,
            format!("the query string is {} bytes long, at most {MAX_QUERY_BYTES} allowed", raw.len()),
        ));
    }
    let mut pairs = Vec::new();
    for part in raw.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = part.split_once('=').unwrap_or((part, ""));
        let decode = |s: &str| {
            percent_decode(s)
                .ok_or_else(|| reject(StatusCode::BAD_REQUEST, format!("malformed query string: {part:?}")))
        };
        pairs.push((decode(k)?, decode(v)?));
    }
    Ok(pairs)
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// One integer query parameter within `[lo, hi]`; absent: `None`.
pub(super) fn int_param(
    pairs: &[(String, String)],
    name: &str,
    lo: i64,
    hi: i64,
) -> Result<Option<i64>, Reject> {
    let Some((_, v)) = pairs.iter().find(|(k, _)| k == name) else { return Ok(None) };
    match v.parse::<i64>() {
        Ok(n) if (lo..=hi).contains(&n) => Ok(Some(n)),
        Ok(n) => Err(reject(StatusCode::BAD_REQUEST, format!("{name}={n} is out of range ({lo} to {hi})"))),
        Err(_) => Err(reject(StatusCode::BAD_REQUEST, format!("{name}={v:?} is not a whole number"))),
    }
}

/// A job id from the path: a 400 when it is not a number.
pub(super) fn job_id(raw: &str) -> Result<u64, Reject> {
    raw.parse().map_err(|_| reject(StatusCode::BAD_REQUEST, format!("{raw:?} is not a job id")))
}

/// Keeps `RawQuery` in the public signature of the handlers in `api`.
pub(super) type Query = RawQuery;
pub(super) type WebState = State<Web>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_strings_decode_or_say_what_is_malformed() {
        let pairs = query_pairs(&Some("metric=step_ms&from=10&name=a%20b+c&flag".into())).unwrap();
        assert_eq!(pairs[2], ("name".into(), "a b c".into()));
        assert_eq!(pairs[3], ("flag".into(), String::new()));
        assert!(query_pairs(&Some("from=%zz".into())).is_err());
        assert!(query_pairs(&Some("x=%E2%28".into())).is_err(), "invalid UTF-8");
        assert_eq!(int_param(&pairs, "from", 0, 100).unwrap(), Some(10));
        assert!(int_param(&pairs, "from", 11, 100).is_err());
        assert!(int_param(&[("from".into(), "1e9".into())], "from", 0, 100).is_err());
        assert!(job_id("12x").is_err());
    }

    mod props {
        use proptest::prelude::*;

        use super::*;

        fn encode(s: &str) -> String {
            s.bytes().map(|b| format!("%{b:02X}")).collect()
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

            /// Any query string: pairs or a 400, never a panic; integers in range or a 400.
            #[test]
            fn any_query_string_is_pairs_or_a_400(raw in "(?s).{0,200}", lo in -5i64..5, hi in 5i64..50) {
                if let Ok(pairs) = query_pairs(&Some(raw)) {
                    for (k, _) in &pairs {
                        match int_param(&pairs, k, lo, hi) {
                            Ok(Some(n)) => prop_assert!((lo..=hi).contains(&n)),
                            Ok(None) => prop_assert!(false, "the key is there"),
                            Err(r) => prop_assert_eq!(r.status, StatusCode::BAD_REQUEST),
                        }
                    }
                }
            }

            /// Whatever a browser encodes decodes back to what it encoded.
            #[test]
            fn encoded_pairs_decode_back(pairs in proptest::collection::vec(("\\PC{0,12}", "\\PC{0,12}"), 0..6)) {
                let raw: Vec<String> = pairs.iter().map(|(k, v)| format!("{}={}", encode(k), encode(v))).collect();
                let raw = raw.join("&");
                let decoded = query_pairs(&Some(raw)).expect("well-formed");
                prop_assert_eq!(decoded, pairs);
            }
        }
    }
}
