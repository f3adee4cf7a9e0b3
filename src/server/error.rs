//! OpenAI's error object and its HTTP status: what every refusal and
//! failure of the server sends.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

/// An error as OpenAI sends it: a status and
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (429).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// A 400 `invalid_request_error` about `param`.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
            retry_after: None,
        }
    }

    /// The error of a field inside the object at `prefix`: its param (and
    /// the field's name in the message) become `prefix.field`.
    pub fn param_in(mut self, prefix: &str) -> Self {
        if let Some(p) = self.param.take() {
            let full = format!("{prefix}.{p}");
            self.message = self
                .message
                .replacen(&format!("'{p}'"), &format!("'{full}'"), 1);
            self.param = Some(full);
        }
        self
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn status(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            ..ApiError::invalid(None, message)
        }
    }

    /// The `error` object (also sent as a stream chunk after a failure
    /// once the stream has started).
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}
