//! `ferry-kube`: a small Kubernetes API client for Ferry's controller, node plugin and e2e.
//!
//! - [`Config`]: a kubeconfig (`--kubeconfig`, `KUBECONFIG`, `~/.kube/config`; bearer token, token
//!   file, client certificate or exec plugin) or the in-cluster service account, token re-read on
//!   every request.
//! - [`Client`]: JSON over HTTPS (hyper + rustls, no Kubernetes type crates, to keep compile
//!   times small): [`Client::get_pvc`], [`Client::get_service_account`],
//!   [`Client::create_token`] (TokenRequest), generic get/list/create/patch/delete, and
//!   [`Client::apply`] (server-side apply with discovery, optionally as a server-side dry run).
//!
//! Tokens are [`Secret`]s: `Debug` shows `<redacted>`, and no body is ever logged.

pub mod apply;
pub mod client;
pub mod config;
pub mod error;
pub mod time;

pub use apply::{parse_documents, ApiResource, DryRun};
pub use client::{Annotations, Client, ServiceAccountToken};
pub use config::{Auth, Config, Secret};
pub use error::KubeError;
