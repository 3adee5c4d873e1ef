//! Key layout of slot metadata inside a hash slot. Every key starts with a one-byte kind and is built from
//! self-delimiting segments, so no key of one kind is a prefix of another's and scans by prefix are exact.

use crate::model::{Uid, PLUGIN_NAME_BYTES_MAX};
use tidings_types::{ChannelId, Seq};

/// Kinds of metadata keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    User = b'u',
    Device = b'd',
    SystemUid = b'y',
    Channel = b'c',
    Subscriber = b's',
    Allow = b'a',
    Deny = b'x',
    Membership = b'm',
    CmdBinding = b'k',
    RuntimeMeta = b'r',
    Task = b't',
    Plugin = b'p',
    Event = b'e',
    GroupIntent = b'g',
    SlotRecord = b'o',
    SlotMark = b'z',
}

/// Builds keys from segments.
pub(crate) struct Key(Vec<u8>);

impl Key {
    pub(crate) fn new(kind: Kind) -> Self {
        Key(vec![kind as u8])
    }

    pub(crate) fn uid(mut self, uid: &Uid) -> Self {
        let bytes = uid.as_str().as_bytes();
        // Uids are at most UID_BYTES_MAX (128) bytes, checked at construction.
        self.0.push(u8::try_from(bytes.len()).expect("uid length checked at construction"));
        self.0.extend_from_slice(bytes);
        self
    }

    pub(crate) fn channel(mut self, channel: &ChannelId) -> Self {
        channel.encode_key(&mut self.0);
        self
    }

    /// A length-prefixed text segment. Callers refuse longer text first: a longer one would be cut to
    /// 255 bytes, and two texts alike in those would name the same key.
    pub(crate) fn text(mut self, text: &str) -> Self {
        let bytes = text.as_bytes();
        debug_assert!(bytes.len() <= usize::from(u8::MAX), "text segment of {} bytes", bytes.len());
        let len = u8::try_from(bytes.len()).unwrap_or(u8::MAX);
        self.0.push(len);
        self.0.extend_from_slice(&bytes[..usize::from(len)]);
        self
    }

    pub(crate) fn u8(mut self, value: u8) -> Self {
        self.0.push(value);
        self
    }

    pub(crate) fn u16(mut self, value: u16) -> Self {
        self.0.extend_from_slice(&value.to_be_bytes());
        self
    }

    pub(crate) fn u64(mut self, value: u64) -> Self {
        self.0.extend_from_slice(&value.to_be_bytes());
        self
    }

    pub(crate) fn seq(self, seq: Seq) -> Self {
        self.u64(seq.get())
    }

    pub(crate) fn build(self) -> Vec<u8> {
        self.0
    }
}

/// Reads back a uid segment written by [`Key::uid`] at the start of `bytes`.
pub(crate) fn read_uid(bytes: &[u8]) -> Option<(Uid, &[u8])> {
    let (&len, rest) = bytes.split_first()?;
    let len = usize::from(len);
    if rest.len() < len {
        return None;
    }
    let (uid, rest) = rest.split_at(len);
    Some((Uid::new(std::str::from_utf8(uid).ok()?)?, rest))
}

/// The key of `uid`'s binding of `plugin`; `None` for a name longer than [`PLUGIN_NAME_BYTES_MAX`],
/// which no binding can have.
pub(crate) fn plugin_key(uid: &Uid, plugin: &str) -> Option<Vec<u8>> {
    (plugin.len() <= PLUGIN_NAME_BYTES_MAX).then(|| Key::new(Kind::Plugin).uid(uid).text(plugin).build())
}
