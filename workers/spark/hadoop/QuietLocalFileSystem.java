package statekeeper.hadoop;

import org.apache.hadoop.fs.LocalFileSystem;

/**
 * Hadoop's checksummed local file system (the `file:` scheme's default, which RocksDB's state file manager requires)
 * over QuietRawLocalFileSystem: the same files and .crc side files, written without forking `chmod`.
 */
public class QuietLocalFileSystem extends LocalFileSystem {
  public QuietLocalFileSystem() {
    super(new QuietRawLocalFileSystem());
  }
}
