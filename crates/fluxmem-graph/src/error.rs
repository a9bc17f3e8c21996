/// Errors of the graph model and its Arrow mapping.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A record batch does not have the column the schema requires, or has it with another type.
    #[error("column `{column}`: {reason}")]
    Schema {
        /// The column name.
        column: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A value in a row cannot be mapped back to the graph model (bad enum tag, bad JSON).
    #[error("row {row}, column `{column}`: {reason}")]
    Value {
        /// Row index inside the batch.
        row: usize,
        /// The column name.
        column: String,
        /// What is wrong with the value.
        reason: String,
    },
    /// Building an Arrow batch failed (a bug in the mapping, reported rather than panicking).
    #[error("arrow: {0}")]
    Arrow(#[from] arrow_schema::ArrowError),
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
