//! Kubelet plugin registration, served by `ferry-node` itself (in place of the
//! `node-driver-registrar` sidecar).
//!
//! Kubelet watches `<kubelet-root>/plugins_registry` for sockets. For each new one it calls the
//! `pluginregistration.Registration` service there: `GetInfo` (we answer `CSIPlugin`, the driver
//! name, the CSI socket's path as kubelet on the host sees it, and the versions `["1.0.0"]`), then
//! `NodeGetInfo` on that CSI socket, then `NotifyRegistrationStatus` with its verdict. A refusal
//! is logged at error with kubelet's message and fails [`RegistrationState::health`] until kubelet
//! registers the plugin again.
//!
//! The socket is `<registration-dir>/<driver>-reg.sock`. It is bound (a stale one removed) only
//! after this process owns the node's mounts, so a successor's new socket tells kubelet to
//! register again; bound again if another process removes it (see [`serve`]); on the way out it
//! is removed only while the path still names our socket (see
//! [`ferry_csi::endpoint::OwnedSocket`]). Each connection goes through [`crate::authority`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ferry_csi::endpoint::OwnedSocket;
use ferry_proto::pluginregistration::registration_server::{Registration, RegistrationServer};
use ferry_proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use tonic::{Request, Response, Status};

/// The plugin type of a CSI driver in kubelet's registration API.
pub const CSI_PLUGIN_TYPE: &str = "CSIPlugin";

/// The CSI versions kubelet may speak to the driver.
pub const SUPPORTED_VERSIONS: &[&str] = &["1.0.0"];

/// The registration socket's path for `driver` in `dir` (kubelet's `plugins_registry`).
pub fn socket_path(dir: &Path, driver: &str) -> PathBuf {
    dir.join(format!("{driver}-reg.sock"))
}

/// What kubelet last said about the registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Kubelet has not answered yet.
    Pending,
    Registered,
    /// Kubelet refused the plugin, with its message.
    Refused(String),
}

/// Kubelet's verdict, shared by the registration service and the health endpoint.
#[derive(Debug, Clone)]
pub struct RegistrationState {
    verdict: Arc<Mutex<Verdict>>,
    socket: Arc<Mutex<Option<Arc<OwnedSocket>>>>,
    /// Set on the way out: the socket is not bound again once removed.
    stopping: Arc<AtomicBool>,
}

impl Default for RegistrationState {
    fn default() -> Self {
        RegistrationState {
            verdict: Arc::new(Mutex::new(Verdict::Pending)),
            socket: Arc::default(),
            stopping: Arc::default(),
        }
    }
}

impl RegistrationState {
    pub fn verdict(&self) -> Verdict {
        self.verdict.lock().expect("verdict lock").clone()
    }

    fn set(&self, v: Verdict) {
        *self.verdict.lock().expect("verdict lock") = v;
    }

    /// On the way out: removes the registration socket if the path still names the one this
    /// process bound last (kubelet then unregisters the plugin, as with node-driver-registrar on
    /// SIGTERM; a successor's socket stays), and binds none again. `Ok(None)` when none was bound.
    pub fn remove_socket(&self) -> std::io::Result<Option<(PathBuf, bool)>> {
        self.stopping.store(true, Ordering::SeqCst);
        let socket = self.socket.lock().expect("socket lock").clone();
        match socket {
            Some(s) => Ok(Some((s.path().to_path_buf(), s.remove()?))),
            None => Ok(None),
        }
    }

    /// `Err(reason)` when kubelet refused the plugin, or when the registration socket this
    /// process bound is gone or replaced (kubelet can no longer reach it: a restart binds it
    /// anew). Pending counts as healthy, as with node-driver-registrar.
    pub fn health(&self) -> Result<(), String> {
        if let Verdict::Refused(why) = self.verdict() {
            return Err(format!("kubelet refused the plugin registration: {why}"));
        }
        if let Some(socket) = self.socket.lock().expect("socket lock").as_ref() {
            if !socket.is_ours() {
                return Err(format!(
                    "the registration socket {} is gone or another process's",
                    socket.path().display()
                ));
            }
        }
        Ok(())
    }
}

/// The `pluginregistration.Registration` service.
#[derive(Debug, Clone)]
pub struct RegistrationService {
    /// The driver name.
    pub driver: String,
    /// The CSI socket as kubelet on the host sees it.
    pub endpoint: String,
    pub state: RegistrationState,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _req: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: CSI_PLUGIN_TYPE.to_string(),
            name: self.driver.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|v| v.to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        req: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = req.into_inner();
        if status.plugin_registered {
            tracing::info!(driver = %self.driver, endpoint = %self.endpoint, "kubelet registered the plugin");
            self.state.set(Verdict::Registered);
        } else {
            tracing::error!(driver = %self.driver, endpoint = %self.endpoint, error = %status.error, "kubelet refused the plugin registration");
            self.state.set(Verdict::Refused(status.error));
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// How often [`serve`] checks that the registration socket is still there.
pub const WATCH: std::time::Duration = std::time::Duration::from_secs(5);

/// Binds the registration socket (replacing whatever file is at its path, so kubelet sees a new
/// socket and registers again) and serves `service` on it until `shutdown` resolves.
///
/// While it serves, the path is checked every [`WATCH`]: a socket file removed by another
/// process is bound again, so kubelet registers the plugin again. That happens on the first
/// upgrade from a chart that ran node-driver-registrar: the old pod's registrar, stopping after the
/// new pod bound the socket, removes the path whoever bound it. A path that names someone else's
/// socket is left alone (a successor's). Remove the socket on the way out with
/// [`RegistrationState::remove_socket`].
pub fn serve(
    path: &Path,
    service: RegistrationService,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let mut current = bind_and_serve(path, &service)?;
    let path = path.to_path_buf();
    tokio::spawn(async move {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                _ = tokio::time::sleep(WATCH) => {}
            }
            let gone = std::fs::symlink_metadata(&path)
                .is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound);
            if !gone || service.state.stopping.load(Ordering::SeqCst) {
                continue;
            }
            tracing::warn!(socket = %path.display(), "the registration socket was removed by another process; binding it again so kubelet registers the plugin");
            match bind_and_serve(&path, &service) {
                Ok(next) => {
                    let _ = std::mem::replace(&mut current, next).send(());
                }
                Err(e) => {
                    tracing::error!(socket = %path.display(), error = %e, "binding the registration socket again failed")
                }
            }
        }
        let _ = current.send(());
    });
    Ok(())
}

/// Binds `path`, records the socket in the service's state and serves on it until the returned
/// sender fires (or is dropped).
fn bind_and_serve(
    path: &Path,
    service: &RegistrationService,
) -> std::io::Result<tokio::sync::oneshot::Sender<()>> {
    let (socket, incoming) = OwnedSocket::bind(path)?;
    *service.state.socket.lock().expect("socket lock") = Some(Arc::new(socket));
    tracing::info!(socket = %path.display(), endpoint = %service.endpoint, "kubelet plugin registration socket bound");
    // Every connection through the :authority rewriter (see crate::authority): kubelet's
    // registration client sends the socket path there, which h2 refuses.
    let slots = Arc::new(tokio::sync::Semaphore::new(
        crate::authority::MAX_CONNECTIONS,
    ));
    let incoming = futures::StreamExt::then(incoming, move |conn| {
        let slots = slots.clone();
        async move {
            let permit = slots
                .acquire_owned()
                .await
                .expect("the semaphore is never closed");
            conn.map(|c| crate::authority::localhost_authority(c, permit))
        }
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let service = service.clone();
    tokio::spawn(async move {
        let served = tonic::transport::Server::builder()
            .layer(ferry_csi::log::RpcLogLayer)
            .add_service(RegistrationServer::new(service))
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            })
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "serving the registration socket failed");
        }
    });
    Ok(stop)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service() -> RegistrationService {
        RegistrationService {
            driver: "s3.csi.ferry.dev".into(),
            endpoint: "/var/lib/kubelet/plugins/s3.csi.ferry.dev/csi.sock".into(),
            state: RegistrationState::default(),
        }
    }

    #[tokio::test]
    async fn a_refusal_fails_health_until_kubelet_registers() {
        let s = service();
        assert_eq!(s.state.verdict(), Verdict::Pending);
        s.state.health().unwrap();
        let refuse = RegistrationStatus {
            plugin_registered: false,
            error: "version 0.3 unsupported".into(),
        };
        s.notify_registration_status(Request::new(refuse))
            .await
            .unwrap();
        let why = s.state.health().unwrap_err();
        assert!(why.contains("version 0.3 unsupported"), "{why}");
        let ok = RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        };
        s.notify_registration_status(Request::new(ok))
            .await
            .unwrap();
        assert_eq!(s.state.verdict(), Verdict::Registered);
        s.state.health().unwrap();
    }

    #[test]
    fn socket_is_named_after_the_driver() {
        assert_eq!(
            socket_path(
                Path::new("/var/lib/kubelet/plugins_registry"),
                "s3.csi.ferry.dev"
            ),
            PathBuf::from("/var/lib/kubelet/plugins_registry/s3.csi.ferry.dev-reg.sock")
        );
    }
}
