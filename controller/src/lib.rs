//! Ferry's CSI controller as a library, so tests can serve it in-process.

pub mod service;

pub use service::ControllerService;
