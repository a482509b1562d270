//! The parsers of what an S3 server sends, reachable without a network for the fuzz targets in
//! `fuzz/` (not an API: hidden from the docs, no stability promised).

use std::sync::OnceLock;

use aws_sdk_s3::error::ProvideErrorMetadata;
use aws_sdk_s3::operation::list_objects_v2::{
    ListObjectsV2, ListObjectsV2Error, ListObjectsV2Output,
};
use aws_sdk_s3::operation::RequestId;
use aws_smithy_runtime_api::client::runtime_plugin::RuntimePlugin;
use aws_smithy_runtime_api::client::ser_de::{DeserializeResponse, SharedResponseDeserializer};
use aws_smithy_runtime_api::http::{Response, StatusCode};
use aws_smithy_types::body::SdkBody;
use aws_smithy_types::config_bag::{ConfigBag, FrozenLayer};
use ferry_store::{ListPage, StoreError};

use crate::error::{Failure, Target};

/// `<Code>`, `<Message>` and `<RequestId>` of an error body, as the raw GET path reads them.
pub fn error_body(body: &[u8]) -> (Option<String>, Option<String>, Option<String>) {
    let b = crate::raw_get::error_body(body);
    (b.code, b.message, b.request_id)
}

/// A `Content-Range` header's `(first, last, total)`.
pub fn content_range(v: &str) -> Option<(u64, u64, Option<u64>)> {
    crate::get::parse_content_range(v)
}

/// A key or prefix of a LIST asked for with `EncodingType=url`, decoded.
pub fn url_decode(raw: &str) -> Option<String> {
    crate::url_decode(raw)
}

/// A ListObjectsV2 response (`status`, `body`) to a LIST of `prefix` and `delimiter` in bucket
/// `b`, read as the SDK path reads it: the SDK's deserializer, then the page Ferry makes of its
/// output ([`crate::list_page`]), or the error either one gives.
pub fn list_response(
    status: u16,
    body: &[u8],
    prefix: &str,
    delimiter: Option<&str>,
) -> Result<ListPage, StoreError> {
    static OPERATION: OnceLock<FrozenLayer> = OnceLock::new();
    let deser = OPERATION
        .get_or_init(|| {
            ListObjectsV2::new()
                .config()
                .expect("ListObjectsV2's config")
        })
        .load::<SharedResponseDeserializer>()
        .expect("ListObjectsV2 registers its response deserializer");
    let target = Target::Bucket("b");
    let status = StatusCode::try_from(status).map_err(|e| StoreError::Other(e.to_string()))?;
    let response = Response::new(status, SdkBody::from(body.to_vec()));
    let failure = match deser.deserialize_nonstreaming_with_config(&response, &ConfigBag::base()) {
        // As the attempt interceptor refuses it (a response error of a 2xx: transient).
        Ok(_) if status.is_success() && !crate::list_body_whole(body) => Failure::new(
            crate::error::Kind::Transient,
            crate::LIST_CUT_SHORT.to_string(),
        ),
        Ok(out) => match out.downcast::<ListObjectsV2Output>() {
            Ok(out) => match crate::list_page("b", prefix, delimiter, &out) {
                Ok(page) => return Ok(page),
                Err(f) => f,
            },
            Err(_) => unreachable!("ListObjectsV2's deserializer gives its output"),
        },
        Err(e) => match e
            .as_operation_error()
            .and_then(|e| e.downcast_ref::<ListObjectsV2Error>())
        {
            // As `sdk_failure` maps a service error.
            Some(op) => Failure::response(
                target,
                status.as_u16(),
                op.code(),
                op.message(),
                op.meta().request_id().or(op.request_id()),
            ),
            None => Failure::new(crate::error::Kind::Transient, format!("{e:?}")),
        },
    };
    Err(failure.into_store_error(target))
}
