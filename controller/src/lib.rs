//! Ferry's CSI controller as a library, so tests can serve it in-process.

pub mod pvc;
pub mod service;

pub use pvc::PvcAnnotations;
pub use service::ControllerService;
