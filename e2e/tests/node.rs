//! The e2e's one-node cluster ([`ferry_e2e::node::KubeNode`]): kubelet registers the node and it
//! becomes Ready on loopback, and dropping it leaves the host as it was (sysctls kubelet
//! rewrites, its cgroups, mounts and directories).

use ferry_e2e::node::{KubeNode, KubeNodeOptions, KUBELET_SYSCTLS};
use ferry_testkit::kube::{KubeCluster, KubeClusterOptions};

fn sysctls() -> Vec<(String, String)> {
    KUBELET_SYSCTLS
        .iter()
        .map(|k| {
            let v = std::fs::read_to_string(std::path::Path::new("/proc/sys").join(k))
                .unwrap_or_default();
            (k.to_string(), v.trim().to_string())
        })
        .collect()
}

fn mounts() -> Vec<String> {
    ferry_fs::mountinfo::parse(&std::fs::read_to_string("/proc/self/mountinfo").unwrap())
        .into_iter()
        .map(|m| m.mount_point)
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn node_registers_ready_and_leaves_the_host_as_it_found_it() {
    let before = (sysctls(), mounts());
    let cluster = KubeCluster::start_with(KubeClusterOptions {
        workloads: true,
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let kube = cluster.client().await.unwrap();
    let mut node = KubeNode::start_containerd(&KubeNodeOptions {
        sandbox_image: "localhost/ferry-e2e-pause:none".into(),
        base_dir: None,
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let dir = node.dir().to_path_buf();
    node.start_kubelet(&cluster, &kube)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    // kubelet changed the host meanwhile (it sets kernel.panic=10 and friends at every start).
    let root = format!("/sys/fs/cgroup/memory/ferry-node-{}", std::process::id());
    assert!(
        std::path::Path::new(&root).join("kubepods").exists(),
        "kubelet made no pod cgroups under {root}"
    );
    drop(node);
    assert_eq!(sysctls(), before.0, "sysctls kubelet set were not restored");
    assert_eq!(mounts(), before.1, "mounts were left behind");
    assert!(
        !std::path::Path::new(&root).exists(),
        "{root} was left behind"
    );
    assert!(!dir.exists(), "{} was left behind", dir.display());
}
