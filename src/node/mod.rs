//! The node: the sans-IO [`NodeCore`] and what configures it. The threaded runtime around it is
//! [`crate::Node`].

mod config;
mod core;
mod error;
mod message;

pub use self::core::{subscriber_page, ApiId, ApiResult, ChannelStatus, NodeCore, NodeEffect, NodeStatus};
pub use config::NodeConfig;
pub use error::NodeError;
pub use message::{NodeMessage, RemoteAppendError};
