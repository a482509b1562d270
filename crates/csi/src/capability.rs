//! Volume capability checks shared by CreateVolume, ValidateVolumeCapabilities and NodePublish.
//!
//! Ferry volumes are filesystems (access type `mount`; `block` is refused). Supported access modes:
//! every SINGLE_NODE_* mode, MULTI_NODE_READER_ONLY and MULTI_NODE_MULTI_WRITER. MULTI_NODE_SINGLE_WRITER
//! is refused: Ferry cannot stop a second node from writing.

use ferry_volume::MountOptions;

use crate::pb::volume_capability::access_mode::Mode;
use crate::pb::volume_capability::AccessType;
use crate::pb::VolumeCapability;
use crate::CsiError;

/// Whether Ferry serves this access mode.
pub fn mode_supported(mode: Mode) -> bool {
    match mode {
        Mode::SingleNodeWriter
        | Mode::SingleNodeReaderOnly
        | Mode::SingleNodeSingleWriter
        | Mode::SingleNodeMultiWriter
        | Mode::MultiNodeReaderOnly
        | Mode::MultiNodeMultiWriter => true,
        Mode::Unknown | Mode::MultiNodeSingleWriter => false,
    }
}

/// Whether the mode only allows reading.
pub fn mode_read_only(mode: Mode) -> bool {
    matches!(mode, Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly)
}

/// Checks one capability; returns its access mode. Mount flags are parsed so that a bad option is
/// refused when the volume is created or validated, not first when a pod starts.
pub fn check(cap: &VolumeCapability) -> Result<Mode, CsiError> {
    match &cap.access_type {
        None => {
            return Err(CsiError::InvalidArgument(
                "volume_capability.access_type is required (mount)".to_string(),
            ))
        }
        Some(AccessType::Block(_)) => return Err(CsiError::InvalidArgument(
            "block access is not supported: Ferry volumes are filesystems (use access type mount)"
                .to_string(),
        )),
        Some(AccessType::Mount(m)) => {
            MountOptions::parse(&m.mount_flags)?;
        }
    }
    let raw = cap
        .access_mode
        .as_ref()
        .ok_or_else(|| {
            CsiError::InvalidArgument("volume_capability.access_mode is required".to_string())
        })?
        .mode;
    let mode = Mode::try_from(raw)
        .map_err(|_| CsiError::InvalidArgument(format!("unknown access mode {raw}")))?;
    if !mode_supported(mode) {
        return Err(CsiError::InvalidArgument(format!(
            "access mode {} is not supported",
            mode.as_str_name()
        )));
    }
    Ok(mode)
}

/// Mount flags of a mount capability (empty for anything else).
pub fn mount_flags(cap: &VolumeCapability) -> &[String] {
    match &cap.access_type {
        Some(AccessType::Mount(m)) => &m.mount_flags,
        _ => &[],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::volume_capability::{AccessMode, BlockVolume, MountVolume};

    fn cap(access: Option<AccessType>, mode: Mode) -> VolumeCapability {
        VolumeCapability {
            access_type: access,
            access_mode: Some(AccessMode { mode: mode as i32 }),
        }
    }

    #[test]
    fn checks() {
        let mount = || Some(AccessType::Mount(MountVolume::default()));
        assert_eq!(
            check(&cap(mount(), Mode::SingleNodeWriter)).unwrap(),
            Mode::SingleNodeWriter
        );
        assert!(check(&cap(mount(), Mode::MultiNodeSingleWriter)).is_err());
        assert!(check(&cap(mount(), Mode::Unknown)).is_err());
        assert!(check(&cap(
            Some(AccessType::Block(BlockVolume {})),
            Mode::SingleNodeWriter
        ))
        .is_err());
        assert!(check(&cap(None, Mode::SingleNodeWriter)).is_err());
        let bad_flag = Some(AccessType::Mount(MountVolume {
            mount_flags: vec!["bogus".into()],
            ..Default::default()
        }));
        let e = check(&cap(bad_flag, Mode::SingleNodeWriter)).unwrap_err();
        assert!(e.to_string().contains("bogus"));
        assert!(mode_read_only(Mode::MultiNodeReaderOnly));
    }
}
