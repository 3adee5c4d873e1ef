//! Channel addressing: a chat backend names a channel by its id and its type.

use serde::{Deserialize, Serialize};
use std::{fmt, sync::Arc};

/// Longest channel id accepted, in bytes. Ids are keys in every store and on every frame, so they are
/// bounded at the boundary.
pub const CHANNEL_ID_BYTES_MAX: usize = 255;

/// The kind of a channel. Known kinds have constants; hosts may define their own values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ChannelType(pub u8);

impl ChannelType {
    /// A one-to-one conversation between two users.
    pub const PERSON: ChannelType = ChannelType(1);
    /// A group conversation.
    pub const GROUP: ChannelType = ChannelType(2);
    /// A customer-service conversation.
    pub const CUSTOMER_SERVICE: ChannelType = ChannelType(3);
    /// A community.
    pub const COMMUNITY: ChannelType = ChannelType(4);
    /// A topic inside a community.
    pub const COMMUNITY_TOPIC: ChannelType = ChannelType(5);
    /// An information (broadcast) channel.
    pub const INFO: ChannelType = ChannelType(6);
    /// A data channel that carries no user-visible messages.
    pub const DATA: ChannelType = ChannelType(7);
    /// A temporary channel.
    pub const TEMP: ChannelType = ChannelType(8);
    /// A live-streaming room.
    pub const LIVE: ChannelType = ChannelType(9);
    /// A visitors channel.
    pub const VISITORS: ChannelType = ChannelType(10);

    /// `true` for one-to-one channels, which fan out without paging.
    pub const fn is_person(self) -> bool {
        self.0 == Self::PERSON.0
    }
}

/// Why a channel id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChannelIdError {
    /// The id is empty.
    #[error("channel id is empty")]
    Empty,
    /// The id is longer than [`CHANNEL_ID_BYTES_MAX`].
    #[error("channel id is {len} bytes, more than the {max} allowed")]
    TooLong {
        /// Length of the refused id.
        len: usize,
        /// The limit.
        max: usize,
    },
}

/// A channel: its id and its type. Cheap to clone (the id is shared).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ChannelId {
    kind: ChannelType,
    id: Arc<str>,
}

impl ChannelId {
    /// Builds a channel id, refusing empty or oversized ids.
    pub fn new(kind: ChannelType, id: &str) -> Result<Self, ChannelIdError> {
        check_id(id)?;
        Ok(Self { kind, id: Arc::from(id) })
    }

    /// The channel's type.
    pub fn kind(&self) -> ChannelType {
        self.kind
    }

    /// The channel's id within its type.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The key hashed to find the channel's slot: its id bytes. Channels of different types with one id
    /// share a slot, which keeps a conversation's metadata together.
    pub fn route_key(&self) -> &[u8] {
        self.id.as_bytes()
    }

    /// Appends a self-delimiting encoding (`type, length, id`) usable as a storage key prefix: no
    /// encoded channel is a prefix of another, and keys of one channel sort together.
    pub fn encode_key(&self, out: &mut Vec<u8>) {
        out.push(self.kind.0);
        // Cannot truncate: ids are at most CHANNEL_ID_BYTES_MAX = 255 bytes, checked in `new`.
        out.push(u8::try_from(self.id.len()).expect("channel id length checked at construction"));
        out.extend_from_slice(self.id.as_bytes());
    }

    /// Decodes a key written by [`ChannelId::encode_key`], returning the channel and the remaining bytes.
    /// `None` if the bytes are not a valid encoding.
    pub fn decode_key(bytes: &[u8]) -> Option<(ChannelId, &[u8])> {
        let (&kind, rest) = bytes.split_first()?;
        let (&len, rest) = rest.split_first()?;
        let len = usize::from(len);
        if rest.len() < len {
            return None;
        }
        let (id, rest) = rest.split_at(len);
        let id = std::str::from_utf8(id).ok()?;
        let channel = ChannelId::new(ChannelType(kind), id).ok()?;
        Some((channel, rest))
    }
}

fn check_id(id: &str) -> Result<(), ChannelIdError> {
    if id.is_empty() {
        return Err(ChannelIdError::Empty);
    }
    if id.len() > CHANNEL_ID_BYTES_MAX {
        return Err(ChannelIdError::TooLong { len: id.len(), max: CHANNEL_ID_BYTES_MAX });
    }
    Ok(())
}

impl fmt::Debug for ChannelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.kind.0, self.id)
    }
}

impl fmt::Display for ChannelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl<'de> Deserialize<'de> for ChannelId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // The id borrowed from the input when the format allows (a frame decoded from its buffer
        // does): every peer message names its channel, and the id is copied once, into the `Arc`.
        #[derive(Deserialize)]
        struct Raw<'a> {
            kind: ChannelType,
            #[serde(borrow)]
            id: std::borrow::Cow<'a, str>,
        }
        let raw = Raw::deserialize(d)?;
        ChannelId::new(raw.kind, &raw.id).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decoded_id_is_checked_as_a_built_one() {
        let channel = ChannelId::new(ChannelType::GROUP, "g1").expect("valid");
        let bytes = postcard::to_allocvec(&channel).expect("encodes");
        assert_eq!(postcard::from_bytes::<ChannelId>(&bytes).expect("decodes"), channel);
        // The same encoding with an empty id, and with one past the limit: refused, not built.
        #[derive(Serialize)]
        struct Raw<'a> {
            kind: ChannelType,
            id: &'a str,
        }
        let long = "x".repeat(CHANNEL_ID_BYTES_MAX + 1);
        for id in ["", long.as_str()] {
            let bytes = postcard::to_allocvec(&Raw { kind: ChannelType::GROUP, id }).expect("encodes");
            assert!(postcard::from_bytes::<ChannelId>(&bytes).is_err(), "id of {} bytes", id.len());
        }
    }

    #[test]
    fn refuses_empty_and_long_ids() {
        assert_eq!(ChannelId::new(ChannelType::GROUP, ""), Err(ChannelIdError::Empty));
        let long = "x".repeat(CHANNEL_ID_BYTES_MAX + 1);
        assert!(matches!(
            ChannelId::new(ChannelType::GROUP, &long),
            Err(ChannelIdError::TooLong { len: 256, max: 255 })
        ));
        assert!(ChannelId::new(ChannelType::GROUP, &long[..255]).is_ok());
    }

    #[test]
    fn key_encoding_round_trips_and_is_prefix_free() {
        let a = ChannelId::new(ChannelType::GROUP, "ab").unwrap();
        let b = ChannelId::new(ChannelType::GROUP, "abc").unwrap();
        let (mut ka, mut kb) = (Vec::new(), Vec::new());
        a.encode_key(&mut ka);
        b.encode_key(&mut kb);
        assert!(!kb.starts_with(&ka));
        ka.extend_from_slice(b"tail");
        let (decoded, rest) = ChannelId::decode_key(&ka).unwrap();
        assert_eq!(decoded, a);
        assert_eq!(rest, b"tail");
    }

    #[test]
    fn decode_key_refuses_garbage() {
        assert!(ChannelId::decode_key(&[]).is_none());
        assert!(ChannelId::decode_key(&[2, 5, b'a']).is_none());
        assert!(ChannelId::decode_key(&[2, 0]).is_none());
        assert!(ChannelId::decode_key(&[2, 2, 0xff, 0xfe]).is_none());
    }

    #[test]
    fn serde_refuses_invalid_ids() {
        #[derive(Serialize)]
        struct Raw<'a> {
            kind: u8,
            id: &'a str,
        }
        let bytes = postcard::to_allocvec(&Raw { kind: 2, id: "" }).unwrap();
        assert!(postcard::from_bytes::<ChannelId>(&bytes).is_err());
        let ok = ChannelId::new(ChannelType::PERSON, "u1@u2").unwrap();
        let bytes = postcard::to_allocvec(&ok).unwrap();
        assert_eq!(postcard::from_bytes::<ChannelId>(&bytes).unwrap(), ok);
    }
}
