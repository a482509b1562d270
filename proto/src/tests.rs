//! Wire-format checks: the field numbers of `csi.proto` are a contract with
//! the official CSI Go bindings, so a few of them are pinned here against
//! hand-encoded protobuf bytes.

use std::collections::HashMap;

use prost::Message;

use crate::csi::v1::{
    volume_capability, CreateVolumeRequest, NodePublishVolumeRequest, NodeStageVolumeRequest,
    VolumeCapability,
};

/// Protobuf key byte for a field number below 16 with the given wire type.
fn key(field: u8, wire_type: u8) -> u8 {
    assert!(field < 16, "single-byte keys only");
    (field << 3) | wire_type
}

const VARINT: u8 = 0;
const LEN: u8 = 2;

/// One length-delimited field holding `payload`.
fn len_field(field: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![key(field, LEN), u8::try_from(payload.len()).unwrap()];
    out.extend_from_slice(payload);
    out
}

/// One `map<string, string>` entry encoded as field `field`.
fn map_entry(field: u8, k: &str, v: &str) -> Vec<u8> {
    let mut entry = len_field(1, k.as_bytes());
    entry.extend(len_field(2, v.as_bytes()));
    len_field(field, &entry)
}

fn one(k: &str, v: &str) -> HashMap<String, String> {
    HashMap::from([(k.to_owned(), v.to_owned())])
}

fn mount_rw() -> VolumeCapability {
    VolumeCapability {
        access_type: Some(volume_capability::AccessType::Mount(
            volume_capability::MountVolume {
                fs_type: String::new(),
                mount_flags: vec!["ro".to_owned()],
                volume_mount_group: String::new(),
            },
        )),
        access_mode: Some(volume_capability::AccessMode {
            mode: volume_capability::access_mode::Mode::SingleNodeMultiWriter as i32,
        }),
    }
}

#[test]
fn node_publish_volume_request_round_trips() {
    let req = NodePublishVolumeRequest {
        volume_id: "vol-1".to_owned(),
        publish_context: one("pc", "1"),
        staging_target_path: "/staging".to_owned(),
        target_path: "/target".to_owned(),
        volume_capability: Some(mount_rw()),
        readonly: true,
        secrets: one("key", "secret"),
        volume_context: one("bucket", "b"),
    };
    let bytes = req.encode_to_vec();
    let back = NodePublishVolumeRequest::decode(bytes.as_slice()).unwrap();
    assert_eq!(back, req);
}

#[test]
fn node_publish_volume_request_field_numbers() {
    // Each field encoded alone, so map ordering never matters.
    let cases: Vec<(NodePublishVolumeRequest, Vec<u8>)> = vec![
        (
            NodePublishVolumeRequest {
                volume_id: "v".to_owned(),
                ..Default::default()
            },
            len_field(1, b"v"),
        ),
        (
            NodePublishVolumeRequest {
                publish_context: one("a", "b"),
                ..Default::default()
            },
            map_entry(2, "a", "b"),
        ),
        (
            NodePublishVolumeRequest {
                staging_target_path: "/s".to_owned(),
                ..Default::default()
            },
            len_field(3, b"/s"),
        ),
        (
            NodePublishVolumeRequest {
                target_path: "/t".to_owned(),
                ..Default::default()
            },
            // 0x22: field 4, wire type 2.
            vec![0x22, 2, b'/', b't'],
        ),
        (
            NodePublishVolumeRequest {
                volume_capability: Some(VolumeCapability::default()),
                ..Default::default()
            },
            len_field(5, b""),
        ),
        (
            NodePublishVolumeRequest {
                readonly: true,
                ..Default::default()
            },
            vec![key(6, VARINT), 1],
        ),
        (
            NodePublishVolumeRequest {
                secrets: one("k", "s"),
                ..Default::default()
            },
            map_entry(7, "k", "s"),
        ),
        (
            NodePublishVolumeRequest {
                volume_context: one("k", "v"),
                ..Default::default()
            },
            // 0x42: field 8, wire type 2; entry = {1: "k", 2: "v"}.
            vec![0x42, 6, 0x0a, 1, b'k', 0x12, 1, b'v'],
        ),
    ];
    for (msg, wire) in cases {
        assert_eq!(msg.encode_to_vec(), wire, "encoding {msg:?}");
        assert_eq!(
            NodePublishVolumeRequest::decode(wire.as_slice()).unwrap(),
            msg,
            "decoding {wire:02x?}"
        );
    }
}

#[test]
fn hand_encoded_node_publish_volume_request_decodes() {
    let mut wire = len_field(1, b"vol");
    wire.extend(len_field(4, b"/mnt/t"));
    wire.extend(len_field(5, &len_field(2, b""))); // capability: mount {}
    wire.extend([key(6, VARINT), 1]);
    wire.extend(map_entry(8, "prefix", "p/"));
    let req = NodePublishVolumeRequest::decode(wire.as_slice()).unwrap();
    assert_eq!(req.volume_id, "vol");
    assert_eq!(req.target_path, "/mnt/t");
    assert!(req.staging_target_path.is_empty());
    assert!(req.readonly);
    assert!(matches!(
        req.volume_capability.unwrap().access_type,
        Some(volume_capability::AccessType::Mount(_))
    ));
    assert_eq!(req.volume_context, one("prefix", "p/"));
    assert!(req.secrets.is_empty());
}

#[test]
fn other_field_numbers() {
    // NodeStageVolumeRequest: staging_target_path = 3, volume_capability = 4,
    // volume_context = 6.
    let stage = NodeStageVolumeRequest {
        staging_target_path: "/s".to_owned(),
        ..Default::default()
    };
    assert_eq!(stage.encode_to_vec(), len_field(3, b"/s"));
    let stage = NodeStageVolumeRequest {
        volume_context: one("a", "b"),
        ..Default::default()
    };
    assert_eq!(stage.encode_to_vec(), map_entry(6, "a", "b"));

    // CreateVolumeRequest: secrets = 5, mutable_parameters = 8.
    let create = CreateVolumeRequest {
        secrets: one("a", "b"),
        ..Default::default()
    };
    assert_eq!(create.encode_to_vec(), map_entry(5, "a", "b"));
    let create = CreateVolumeRequest {
        mutable_parameters: one("a", "b"),
        ..Default::default()
    };
    assert_eq!(create.encode_to_vec(), map_entry(8, "a", "b"));

    // VolumeCapability: block = 1, mount = 2, access_mode = 3 with
    // SINGLE_NODE_MULTI_WRITER = 7.
    let mut wire = len_field(2, &len_field(2, b"ro"));
    wire.extend(len_field(3, &[key(1, VARINT), 7]));
    assert_eq!(mount_rw().encode_to_vec(), wire);
}

#[test]
fn enum_values_match_the_spec() {
    use crate::csi::v1::{
        controller_service_capability::rpc::Type as Ctrl,
        node_service_capability::rpc::Type as Node, plugin_capability::service::Type as Svc,
        volume_capability::access_mode::Mode,
    };
    assert_eq!(Mode::SingleNodeSingleWriter as i32, 6);
    assert_eq!(Mode::SingleNodeMultiWriter as i32, 7);
    assert_eq!(Ctrl::VolumeCondition as i32, 11);
    assert_eq!(Ctrl::GetVolume as i32, 12);
    assert_eq!(Ctrl::SingleNodeMultiWriter as i32, 13);
    assert_eq!(Ctrl::ModifyVolume as i32, 14);
    assert_eq!(Node::VolumeCondition as i32, 4);
    assert_eq!(Node::VolumeMountGroup as i32, 6);
    assert_eq!(Svc::GroupControllerService as i32, 3);
}

/// The generated service traits and clients are where callers expect them.
#[allow(dead_code)]
fn generated_paths_exist() {
    fn server<T>()
    where
        T: crate::csi::v1::identity_server::Identity
            + crate::csi::v1::controller_server::Controller
            + crate::csi::v1::node_server::Node
            + crate::csi::v1::group_controller_server::GroupController,
    {
    }
    let _ = crate::csi::v1::identity_client::IdentityClient::<tonic::transport::Channel>::new;
    let _ = crate::csi::v1::controller_client::ControllerClient::<tonic::transport::Channel>::new;
    let _ = crate::csi::v1::node_client::NodeClient::<tonic::transport::Channel>::new;
    assert_eq!(crate::CSI_SPEC_VERSION, "1.11.0");
}

/// Kubelet's registration messages: field numbers pinned against hand-encoded bytes, and the
/// gRPC method paths kubelet calls.
#[test]
fn plugin_registration_wire_format() {
    use crate::pluginregistration::{PluginInfo, RegistrationStatus};
    let info = PluginInfo {
        r#type: "CSIPlugin".into(),
        name: "d".into(),
        endpoint: "/s".into(),
        supported_versions: vec!["1.0.0".into()],
    };
    let mut want = len_field(1, b"CSIPlugin");
    want.extend(len_field(2, b"d"));
    want.extend(len_field(3, b"/s"));
    want.extend(len_field(4, b"1.0.0"));
    assert_eq!(info.encode_to_vec(), want);
    let status = RegistrationStatus::decode(
        [vec![key(1, VARINT), 1], len_field(2, b"no")]
            .concat()
            .as_slice(),
    )
    .unwrap();
    assert!(status.plugin_registered);
    assert_eq!(status.error, "no");
    use crate::pluginregistration::registration_server::RegistrationServer;
    use tonic::server::NamedService;
    struct Unused;
    #[tonic::async_trait]
    impl crate::pluginregistration::registration_server::Registration for Unused {
        async fn get_info(
            &self,
            _: tonic::Request<crate::pluginregistration::InfoRequest>,
        ) -> Result<tonic::Response<PluginInfo>, tonic::Status> {
            unreachable!()
        }
        async fn notify_registration_status(
            &self,
            _: tonic::Request<RegistrationStatus>,
        ) -> Result<
            tonic::Response<crate::pluginregistration::RegistrationStatusResponse>,
            tonic::Status,
        > {
            unreachable!()
        }
    }
    assert_eq!(
        <RegistrationServer<Unused> as NamedService>::NAME,
        "pluginregistration.Registration"
    );
}
