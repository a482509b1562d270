//! What the in-process CSI tests share.

use std::path::Path;
use std::sync::Arc;

use ferry_controller::ControllerService;
use ferry_csi::pb::controller_server::ControllerServer;
use ferry_csi::pb::node_server::NodeServer;
use ferry_csi::stores::Stores;
use ferry_e2e::{unix_channel, ControllerClient, NodeClient};
use ferry_node::NodeService;
use tonic::transport::Channel;

/// Serves a controller on `stores` and `node` in this process, on unix sockets in `dir` (with the
/// RPC log layer, as the binaries do), and returns a client of each.
pub async fn serve(
    dir: &Path,
    stores: Arc<dyn Stores>,
    node: NodeService,
) -> (ControllerClient<Channel>, NodeClient<Channel>) {
    let ctrl_sock = dir.join("ctrl.sock");
    let node_sock = dir.join("node.sock");
    let ctrl_in = ferry_csi::endpoint::bind(&ctrl_sock).unwrap();
    let node_in = ferry_csi::endpoint::bind(&node_sock).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(ferry_csi::log::RpcLogLayer)
            .add_service(ControllerServer::new(ControllerService::new(stores)))
            .serve_with_incoming(ctrl_in),
    );
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(ferry_csi::log::RpcLogLayer)
            .add_service(NodeServer::new(node))
            .serve_with_incoming(node_in),
    );
    (
        ControllerClient::new(unix_channel(&ctrl_sock).await.unwrap()),
        NodeClient::new(unix_channel(&node_sock).await.unwrap()),
    )
}

/// A TCP listener on loopback that counts the connections made to it (and closes each at once):
/// the endpoint a volume names that the operator did not allow.
pub struct Recorder {
    pub url: String,
    connections: Arc<std::sync::atomic::AtomicUsize>,
}

impl Recorder {
    pub fn start() -> Recorder {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = connections.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                // Counted before it is closed: a client that saw the close was counted.
                seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                drop(conn);
            }
        });
        Recorder { url, connections }
    }

    pub fn connections(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::SeqCst)
    }
}
