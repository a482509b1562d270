//! `ferry-controller`: the CSI Identity and Controller services on a unix socket.

use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use ferry_controller::ControllerService;
use ferry_csi::identity::IdentityService;
use ferry_csi::pb::controller_server::ControllerServer;
use ferry_csi::pb::identity_server::IdentityServer;
use ferry_csi::pb::plugin_capability::service::Type as PluginCap;
use ferry_csi::stores::S3Stores;
use ferry_volume::{AllowedEndpoints, Endpoint};

/// Ferry CSI controller: provisions prefix-scoped S3 volumes.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// CSI endpoint, `unix:///path/to/csi.sock`.
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    csi_endpoint: String,
    /// Default S3 endpoint URL for volumes whose StorageClass names none (S3-compatible stores).
    #[arg(long, env = "FERRY_ENDPOINT_URL")]
    endpoint_url: Option<String>,
    /// Default region for volumes whose StorageClass names none (else the AWS SDK's chain).
    #[arg(long, env = "FERRY_REGION")]
    region: Option<String>,
    /// Use path-style addressing by default.
    #[arg(long, env = "FERRY_FORCE_PATH_STYLE")]
    force_path_style: bool,
    /// Endpoints a volume (StorageClass parameter, PV attribute or mount option, volume id) may
    /// name, comma-separated: `aws` (the AWS S3 endpoints of every partition), `scheme://host[:port]`
    /// patterns with `*` inside a host label (`https://*.example.com:9000`), or `*` for any.
    /// Default: `aws`. The --endpoint-url is always allowed.
    #[arg(long, env = "FERRY_ALLOWED_ENDPOINTS", value_parser = parse_allowed_endpoints)]
    allowed_endpoints: Option<AllowedEndpoints>,
    /// Address of the Prometheus `/metrics` endpoint; `off` disables it.
    #[arg(long, env = "FERRY_METRICS_ADDR", default_value = "0.0.0.0:9810")]
    metrics_addr: String,
    /// Address of the `/healthz` endpoint (`host:port` or `:port`): 200 while the controller
    /// serves (its CSI Probe is ready). `off` disables it.
    #[arg(long, env = "FERRY_HEALTH_ADDR", default_value = "off")]
    health_addr: String,
    /// PEM file of CA certificates to trust besides the system's (S3 and STS endpoints with a
    /// private CA).
    #[arg(long, env = "AWS_CA_BUNDLE")]
    ca_bundle: Option<std::path::PathBuf>,
    /// Kubeconfig for the Kubernetes API (reading PVC annotations). Default: in-cluster when
    /// running in a pod (KUBERNETES_SERVICE_HOST), else no API (the annotations are not read).
    #[arg(long, env = "FERRY_KUBECONFIG")]
    kubeconfig: Option<std::path::PathBuf>,
    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, env = "FERRY_LOG", default_value = "info")]
    log: String,
}

/// The current context of the kubeconfig at `path`.
async fn kubeconfig(path: &std::path::Path) -> anyhow::Result<kube::Config> {
    let file = kube::config::Kubeconfig::read_from(path)
        .with_context(|| format!("reading kubeconfig {}", path.display()))?;
    kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
        .await
        .with_context(|| format!("kubeconfig {}", path.display()))
}

fn parse_allowed_endpoints(s: &str) -> Result<AllowedEndpoints, String> {
    AllowedEndpoints::parse(s).map_err(|e| e.to_string())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    ferry_csi::log::init(&args.log).map_err(anyhow::Error::msg)?;
    if let Some(url) = &args.endpoint_url {
        ferry_volume::validate::endpoint_url("--endpoint-url", url)?;
    }
    if let Some(r) = &args.region {
        ferry_volume::validate::region("--region", r)?;
    }
    let socket = ferry_csi::endpoint::parse(&args.csi_endpoint).map_err(anyhow::Error::msg)?;
    ferry_metrics::start(&args.metrics_addr)
        .await
        .map_err(anyhow::Error::msg)?;
    let stores = Arc::new(
        S3Stores::new(Endpoint {
            endpoint_url: args.endpoint_url.clone(),
            region: args.region.clone(),
            force_path_style: args.force_path_style,
        })
        .with_options(ferry_s3::S3Options {
            ca_bundle: args.ca_bundle.clone(),
            ..Default::default()
        })
        .with_allowed_endpoints(args.allowed_endpoints.clone().unwrap_or_default()),
    );
    tracing::info!(allowed = %stores.allowed_endpoints(), "volumes may name these S3 endpoints");
    let kube = if let Some(path) = &args.kubeconfig {
        Some(kubeconfig(path).await?)
    } else if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
        Some(kube::Config::incluster().context("in-cluster Kubernetes configuration")?)
    } else {
        None
    };
    let mut controller = ControllerService::new(stores.clone());
    match kube {
        Some(mut config) => {
            ferry_csi::kube_api::tune(&mut config);
            tracing::info!(server = %config.cluster_url, "reading PVC annotations from the Kubernetes API");
            let client =
                kube::Client::try_from(config).context("building the Kubernetes API client")?;
            controller = controller.with_pvcs(Arc::new(client));
        }
        None => tracing::warn!(
            "no Kubernetes API configured (--kubeconfig, or run in a pod): the {} PVC annotation is not read",
            ferry_volume::keys::EXISTING_PREFIX_ANNOTATION
        ),
    }
    // The driver's own credentials are no condition of serving: a StorageClass may bring its keys
    // in a provisioner Secret (S3-compatible stores), and a Probe that waited for default
    // credentials kept csi-provisioner from ever provisioning (and had kubelet restart the pod).
    // They are checked once, for the log; a volume that needs them and lacks them fails its own
    // CreateVolume or DeleteVolume, naming the reason.
    let check = stores.clone();
    tokio::spawn(async move {
        match check.check_default_credentials().await {
            Ok(()) => tracing::info!("the driver's default credentials resolve"),
            Err(reason) => tracing::warn!(
                %reason,
                "the driver has no default credentials: only StorageClasses with a provisioner \
                 Secret (csi.storage.k8s.io/provisioner-secret-name) can provision and delete"
            ),
        }
    });
    let identity = IdentityService::new(
        vec![PluginCap::ControllerService],
        Box::new(|| Box::pin(async { Ok(()) })),
    );
    ferry_metrics::health::start_health(&args.health_addr, identity.health_check())
        .await
        .map_err(anyhow::Error::msg)?;
    let shutdown = ferry_csi::endpoint::shutdown_signal();
    let incoming = ferry_csi::endpoint::bind(&socket)
        .with_context(|| format!("binding CSI socket {}", socket.display()))?;
    tracing::info!(
        endpoint = %socket.display(),
        version = ferry_csi::VERSION,
        driver = ferry_volume::DRIVER_NAME,
        "ferry-controller serving"
    );
    tonic::transport::Server::builder()
        .layer(ferry_csi::log::RpcLogLayer)
        .add_service(IdentityServer::new(identity))
        .add_service(ControllerServer::new(controller))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .context("serving gRPC")?;
    let _ = std::fs::remove_file(&socket);
    tracing::info!("ferry-controller stopped");
    Ok(())
}
